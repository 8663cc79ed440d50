"""The checkpoint format of DeepSpeed ZeRO engines: DeepSpeed's own files (each rank's
partitions) under `zero/`, with everything that is specific to DeepSpeed.

Its files are checked before DeepSpeed unpickles them (safe_load.py). A ZeRO checkpoint written
at another data-parallel size goes through DeepSpeed's universal checkpoint; it loads into other
engines, and DCP checkpoints load into ZeRO, through whole per-parameter tensors (DeepSpeed's
`safe_set_full_*` API one way, the universal checkpoint's per-parameter files the other).
"""

from __future__ import annotations

import tempfile
from argparse import Namespace
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardyard.checkpoint.collective import Written, barrier, node_scratch, rank, storage_errors
from shardyard.checkpoint.dcp_io import read_dcp
from shardyard.checkpoint.layout import SPEC_FILE, STATE_FILE, ZERO_DIR
from shardyard.checkpoint.record import FileEntry, file_entry
from shardyard.checkpoint.safe_load import check_zero_files
from shardyard.storage.store import RunStorage
from shardyard.models import build_model
from shardyard.layout.blocks import names_of_each_parameter
from shardyard.parallel import Engine
from shardyard.runtime import import_deepspeed
from shardyard.spec import JobSpec


def optimizer_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """Per-parameter state the optimizer keeps (AdamW: step and moments; SGD: momentum)."""
    if isinstance(optimizer, torch.optim.SGD):
        return ["momentum_buffer"] if optimizer.defaults["momentum"] else []
    return ["step", "exp_avg", "exp_avg_sq"]



FullState = Callable[[str, str], torch.Tensor]  # (parameter name, field) -> the whole tensor


def parameter_names(stored: JobSpec) -> dict[str, list[str]]:
    """Every name of each parameter (a tied weight has two; checkpoints may keep one)."""
    with torch.device("meta"):
        model = build_model(stored.model)
    return {name: names for names in names_of_each_parameter(model) for name in names}


@contextmanager
def zero_full_state(storage: RunStorage, name: str, stored: JobSpec, step: int) -> Iterator[FullState]:
    """Collective: whole tensors from a ZeRO checkpoint. AdamW state comes through DeepSpeed's
    universal checkpoint (per-parameter files); its converter knows Adam's state only, so for SGD
    the fp32 weights come from DeepSpeed's zero_to_fp32 and momentum is not carried (refused
    before any worker starts: launcher.check_resume)."""
    aliases = parameter_names(stored)
    if stored.optim.name == "adamw":
        with _universal(storage, name) as universal:
            def from_universal(fqn: str, field: str) -> torch.Tensor:
                params = universal / ZERO_DIR
                present = next((n for n in aliases.get(fqn, [fqn]) if (params / n).is_dir()), fqn)
                if field == "step" and not (params / present / "step.pt").is_file():
                    # ZeRO-3's files keep no step count: one optimizer step per training step.
                    return torch.tensor(float(step))
                return _universal_tensor(params, present, "fp32" if field == "param" else field)
            yield from_universal
        return
    import_deepspeed()  # its accelerator chosen before any of its modules load
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with local_zero_files(storage, name) as zero:
        weights = get_fp32_state_dict_from_zero_checkpoint(str(zero.parent), tag=zero.name)

    def from_weights(fqn: str, field: str) -> torch.Tensor:
        if field != "param":
            raise KeyError(f"{storage.url(name)}: SGD momentum in a ZeRO checkpoint cannot be carried over")
        return weights[next(n for n in aliases.get(fqn, [fqn]) if n in weights)]
    yield from_weights



def state_field(key: str) -> tuple[str, str] | None:
    """(parameter name, field) of a flat state key: `model.<fqn>` or `optim.state.<fqn>.<field>`."""
    kind, _, rest = key.partition(".")
    if kind == "model":
        return rest, "param"
    if rest.startswith("state."):
        fqn, _, field = rest.removeprefix("state.").rpartition(".")
        return fqn, field
    return None  # param_groups: the running optimizer's own settings stay



def write_whole(full: FullState, stored: JobSpec, fields: list[str], directory: Path) -> None:
    """Every parameter (under each of its names) and its optimizer `fields` as one process's DCP
    checkpoint."""
    with torch.device("meta"):
        model = build_model(stored.model)
    state: dict[str, torch.Tensor] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        state[f"model.{fqn}"] = full(fqn, "param").reshape(p.shape)
        for field in fields:
            value = full(fqn, field)
            state[f"optim.state.{fqn}.{field}"] = value.reshape(() if field == "step" else p.shape)
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)



class DeepSpeedFormat:
    """ZeRO: DeepSpeed's own checkpoint (each rank's partitions), under `zero/`."""

    name = "deepspeed"

    def save(self, engine: Engine, storage: RunStorage, name: str, group: dist.ProcessGroup | None) -> Written:
        """Collective, synchronous. DeepSpeed writes its files itself, so their checksums are
        read back from storage afterwards by rank 0 (after every rank's write), not computed as
        they are written as DCP's are."""
        import_deepspeed()  # its accelerator chosen before any of its modules load
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_INFO,
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        # The universal-checkpoint marker lets DeepSpeed's converter reshard this checkpoint later
        # (stages 1 and 2 refuse to convert without it); a model with no tensor-parallel slicing
        # needs nothing else in it.
        info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        url = storage.url(name)
        with storage_errors(url), _writable_local(RunStorage(url)) as local:  # the local copy goes either way
            engine.ds.save_checkpoint(str(local), tag=ZERO_DIR, client_state={UNIVERSAL_CHECKPOINT_INFO: info})
        if not storage.remote:
            # Every rank flushes what it can see before the commit's barrier: on a file system
            # shared by nodes, rank 0's flush at commit reaches its own node's writes only, and
            # each rank's partition file was written on that rank's node.
            RunStorage(url).sync(ZERO_DIR)

        def files() -> dict[str, FileEntry]:
            if rank() != 0:
                return {}
            written = RunStorage(url)
            return {path: file_entry(written, *path.split("/")) for path in _files_under(written)
                    if path not in (SPEC_FILE, STATE_FILE)}
        return Written(None, files)

    def load(self, engine: Engine, storage: RunStorage, name: str, record: dict, stored: JobSpec,
             load_optimizer: bool) -> None:
        if record["format"] != self.name:
            self._load_full_state(engine, self._from_dcp(engine, storage.url(name), record["files"], load_optimizer),
                                  load_optimizer)
        elif record["world_size"] == dist.get_world_size():
            with local_zero_files(storage, name) as zero:
                loaded_from, _ = engine.ds.load_checkpoint(str(zero.parent), tag=zero.name,
                                                           load_optimizer_states=load_optimizer)
            if loaded_from is None:  # DeepSpeed warns and carries on when it finds nothing
                raise FileNotFoundError(f"no ZeRO checkpoint under {storage.url(name, ZERO_DIR)}")
        else:  # resharded through whole tensors (DeepSpeed's universal checkpoint's files)
            with zero_full_state(storage, name, stored, record["step"]) as full:
                self._load_full_state(engine, full, load_optimizer and stored.optim.name == "adamw")

    @staticmethod
    def _from_dcp(engine: Engine, url: str, files: dict[str, FileEntry], load_optimizer: bool) -> FullState:
        """Every rank reads the whole tensors it needs from a DCP checkpoint (each file checked
        against the commit record's `files` as it is read)."""
        shapes = {n: getattr(p, "ds_shape", p.shape) for n, p in engine.ds.module.named_parameters()}
        fields = optimizer_state_keys(engine.optimizers[0]) if load_optimizer else []
        wanted = {f"model.{n}": torch.empty(s) for n, s in shapes.items()}
        wanted |= {f"optim.state.{n}.{f}": torch.empty(() if f == "step" else s) for n, s in shapes.items()
                   for f in fields}
        read_dcp(wanted, url, expected=files)
        return lambda fqn, field: wanted[f"model.{fqn}" if field == "param" else f"optim.state.{fqn}.{field}"]

    @staticmethod
    def _load_full_state(engine: Engine, full: FullState, load_optimizer: bool) -> None:
        """Whole tensors into ZeRO: DeepSpeed's public `safe_set_full_*` API puts each rank's
        partition in place, in the fp32 master copy and the optimizer state."""
        deepspeed = import_deepspeed()
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        stage3 = engine.ds.zero_optimization_stage() == 3
        fields = optimizer_state_keys(engine.optimizers[0]) if load_optimizer else []
        zero_optimizer = engine.ds.optimizer
        inner = zero_optimizer.optimizer  # ours, stepping DeepSpeed's flat fp32 partitions
        # Optimizer state is created at the first step (every stage): zeros here, overwritten
        # below. ZeRO-3 keeps its partitions out of our optimizer's groups.
        flats = (zero_optimizer.fp32_partitioned_groups_flat if stage3
                 else [p for group in inner.param_groups for p in group["params"]])
        for flat in flats:
            state = inner.state[flat]
            for field in fields:
                state.setdefault(field, torch.zeros((), dtype=torch.float32) if field == "step"
                                 else torch.zeros_like(flat))
        if fields and not stage3:
            # Stages 1 and 2 link each parameter to its slice of that state at the first step
            # too; the public safe_set API writes through those links, so make them now.
            zero_optimizer._lazy_init_hp_params_optimizer_state()
        for fqn, p in engine.ds.module.named_parameters():
            shape = getattr(p, "ds_shape", p.shape)  # (ZeRO-3's files hold flat tensors)
            value = full(fqn, "param").reshape(shape)
            safe_set_full_fp32_param(p, value)
            # The working copy the forward pass uses is separate from the fp32 master copy.
            if stage3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if dist.get_rank() == 0:
                        p.data.copy_(value)
            else:
                with torch.no_grad():
                    p.data.copy_(value)
            for field in fields:
                if field != "step":
                    safe_set_full_optimizer_state(p, full(fqn, field).reshape(shape), field)
        if "step" in fields:  # Adam's step count lives per flat partition, the same for all
            step = full(next(n for n, _ in engine.ds.module.named_parameters()), "step")
            for state in inner.state.values():
                state["step"] = step.clone().to(state["step"].dtype)



@contextmanager
def _writable_local(storage: RunStorage) -> Iterator[Path]:
    """A local directory to write into, copied up to `storage` afterwards when that is remote."""
    if not storage.remote:
        Path(storage.root).mkdir(parents=True, exist_ok=True)
        yield Path(storage.root)
        return
    with tempfile.TemporaryDirectory(prefix="shardyard-upload-") as tmp:
        yield Path(tmp)
        storage.fs.put(f"{tmp}/", storage.root, recursive=True)


@contextmanager
def local_zero_files(storage: RunStorage, name: str) -> Iterator[Path]:
    """Checkpoint `name`'s DeepSpeed files (its `zero/`), copied to a directory of this process's
    alone and checked there before DeepSpeed unpickles them unrestricted: DeepSpeed loads the very
    files that were checked (checked in the run's directory, a file swapped after the check would
    run its code). Only `zero/` is copied: the readers' holds beside it come and go while other
    ranks read (a hold listed, then released, failed the copy)."""
    with storage.private_copy(name, ZERO_DIR) as zero:
        check_zero_files(zero)
        yield zero


def _universal_tensor(universal: Path, fqn: str, field: str) -> torch.Tensor:
    value = torch.load(universal / fqn / f"{field}.pt", weights_only=True)
    return value["param"] if isinstance(value, dict) else value


@contextmanager
def _universal(storage: RunStorage, name: str) -> Iterator[Path]:
    """Collective: DeepSpeed's universal checkpoint of ZeRO checkpoint `name` (whole per-parameter
    tensors under its `zero/`), converted once per node into node-local scratch space, removed
    after."""
    import_deepspeed()  # its accelerator chosen before any of its modules load
    from deepspeed.checkpoint import ds_to_universal

    with node_scratch() as (scratch, leader):
        if leader:
            with local_zero_files(storage, name) as zero:
                ds_to_universal.main(Namespace(
                    input_folder=str(zero), output_folder=str(scratch / "universal"),
                    num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                    inject_missing_state=False))
        barrier()
        yield scratch / "universal"
        barrier()


def _files_under(storage: RunStorage) -> list[str]:
    """Every file under the storage's root, by its path relative to it."""
    root = storage.path()
    return sorted(p[len(root):].lstrip("/") for p in storage.fs.find(root))
