"""DeepSpeed's JIT-compiled communication op, built once and never waited on forever.

On a CPU machine DeepSpeed compiles an op (`deepspeed_shm_comm`, about 30 s) the first time a
process initialises its communication, under torch's build lock: a plain file, `lock`, in the
op's build directory under `~/.cache/torch_extensions` (or TORCH_EXTENSIONS_DIR). A process killed
during the build (a failed worker, a user's Ctrl-C, a kill test) leaves that file behind, and
every later start then sleeps forever waiting for it.

torch's default directory is one per Python version, shared by every virtual environment on the
machine; but the build's command names the environment's own include paths, so two environments
(two checkouts, a CI clone beside a working copy) would each find the other's build stale and
rebuild it, 30 s to minutes each time. Unless the user names a directory, shardyard builds in one
of each environment's own. Within one environment, torch runs whichever `ninja` comes first on
the process's PATH: the environment's own (1.13, DeepSpeed's dependency) where its `bin` is on
PATH, as in Ray's workers, and the system's (1.11 here) where it is not. The two record their
builds under different hashes of the same command, so each rebuilt what the other had built; the
build now runs the environment's ninja in every process.

`ensure_deepspeed_ops` builds the op before DeepSpeed starts, holding a kernel lock of its own
(`fcntl.flock`): the kernel releases it when its holder dies, however it dies. Every shardyard
process builds under that lock, so while one holds it no live shardyard build owns torch's lock
file, and a leftover one is removed. (A build by another program, outside this lock, could have
its lock removed; none runs DeepSpeed's op build on a shardyard machine.)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import get_default_build_root

from shardyard.runtime import import_deepspeed

OP_NAME = "deepspeed_shm_comm"  # the build directory's name (ShareMemCommBuilder's op)


def extensions_root() -> Path:
    """TORCH_EXTENSIONS_DIR where the user sets it, otherwise a directory of this Python
    environment's own under torch's default root."""
    if chosen := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(chosen)
    environment = f"{sys.prefix}|{torch.__version__}"
    tag = hashlib.sha256(environment.encode()).hexdigest()[:12]
    return Path(get_default_build_root()) / f"shardyard-py{sys.version_info.major}{sys.version_info.minor}-{tag}"


def stale_locks(root: Path) -> list[Path]:
    """torch's build locks of the op (<root>/<op>/lock)."""
    return [p for p in root.rglob("lock") if p.parent.name.startswith(OP_NAME)]


def ensure_deepspeed_ops() -> None:
    """Build (or find built) the op DeepSpeed's CPU communication loads. Call before
    `deepspeed.init_distributed`; safe from many processes at once."""
    import_deepspeed()  # its accelerator chosen before any of its modules load
    from deepspeed.accelerator import get_accelerator
    import deepspeed.ops

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return  # not used on this accelerator (CUDA communicates through NCCL)
    root = extensions_root()
    root.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(root)  # where torch builds and DeepSpeed later loads it
    with (root / "shardyard-build.lock").open("w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if this process dies
        for lock in stale_locks(root):
            lock.unlink(missing_ok=True)  # left by a builder that died: none builds outside this lock
        use_the_environments_ninja(root / "bin")
        builder.load(verbose=False)


def use_the_environments_ninja(directory: Path) -> None:
    """Puts a directory holding only a link to this environment's ninja first on PATH, for this
    process's JIT builds (this op, and any DeepSpeed builds later, such as CPU Adam's)."""
    import ninja

    link = directory / "ninja"
    target = Path(ninja.BIN_DIR) / "ninja"
    if not (link.is_symlink() and link.readlink() == target):
        directory.mkdir(exist_ok=True)
        staged = directory / f"ninja.{os.getpid()}"
        staged.unlink(missing_ok=True)
        staged.symlink_to(target)
        staged.replace(link)  # atomic: a process starting a build never finds the link missing
    if os.environ.get("PATH", "").split(os.pathsep)[0] != str(directory):
        os.environ["PATH"] = os.pathsep.join([str(directory), os.environ.get("PATH", "")])
