"""Checkpoints: one `CheckpointManager` for every strategy, recovery mode and storage.

A checkpoint is a directory `<storage_path>/<run.name>/checkpoint_step_<step:08d>/` holding:

    spec.json          the job spec that wrote it (rank 0, before anything else)
    trainer_state.pt   train state (step, data position, world size) and the LR schedule (rank 0)
    model + optimizer  `torch.distributed.checkpoint` (DCP) files, every rank writing its own shard,
                       keyed by the full model's parameter names whatever the strategy; or, for
                       DeepSpeed ZeRO, DeepSpeed's own format under `zero/`
    COMMITTED          written last, by rank 0, once every rank's state is in storage

A checkpoint counts only once committed: DCP's metadata is written by its coordinator after every
rank has written its shard (DeepSpeed ends its save with a barrier), and only then does rank 0
write the commit record, in one atomic write. Restarts, serving and export read committed
checkpoints only; a directory that a crash left without a commit record is deleted.

Everything goes straight to the run's storage through fsspec: a local or shared path, or an object
store URI (DCP's fsspec writer; DeepSpeed writes locally and its files are copied up). Ray Train
is told of each committed checkpoint through its public `report` API (`on_commit`), and nothing
here reads Ray's own files.

Any checkpoint resumes under any strategy at any world size: DCP reshards by parameter name, ZeRO
checkpoints written at another data-parallel size go through DeepSpeed's universal checkpoint,
and the two formats load into each other through full per-parameter states (DeepSpeed's
`safe_set_full_*` API one way, the universal checkpoint's per-parameter files the other).
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import time
import warnings
from argparse import Namespace
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardyard.models import build_model, give_storage, materialise
from shardyard.models.blocks import names_of_each_parameter
from shardyard.models.initial_weights import copy_local
from shardyard.parallel import Engine
from shardyard.parallel.tensor import dcp_layout, dcp_load
from shardyard.spec import CustomSpec, DataSpec, HFSpec, JobSpec
from shardyard.train.lease import holding, live_holds
from shardyard.train.storage import COMMIT_FILE, DIR_PREFIX, RunStorage

STATE_FILE = "trainer_state.pt"
SPEC_FILE = "spec.json"
ZERO_DIR = "zero"


@dataclass
class TrainState:
    step: int = 0          # optimizer steps completed
    samples_seen: int = 0  # global position in the sample order (see data/sampler.py)
    world_size: int = 1    # world size that wrote the checkpoint


def checkpoint_name(step: int) -> str:
    return f"{DIR_PREFIX}{step:08d}"


# ----------------------------------------------------------------------------- storage


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest committed checkpoint of a run in a local or shared directory."""
    run_dir = Path(run_dir).absolute()
    name = RunStorage(run_dir).newest_committed()
    return run_dir / name if name else None


def committed_record(checkpoint_dir: str | Path) -> dict[str, Any] | None:
    path = Path(checkpoint_dir) / COMMIT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def is_hf_directory(path: str | Path) -> bool:
    """A Hugging Face model directory that training did not write (config.json, no spec.json)."""
    return (Path(path) / "config.json").is_file() and not (Path(path) / SPEC_FILE).is_file()


def servable(path: str | Path) -> Path | None:
    """What serving loads from `path` now: a committed checkpoint or a Hugging Face model directory
    as given, or a run directory's newest committed checkpoint (None when it has none yet)."""
    given = Path(path).expanduser().resolve()
    if committed_record(given) is not None or is_hf_directory(given):
        return given
    return find_latest(given) if given.is_dir() else None


def read_spec(checkpoint_dir: str | Path) -> JobSpec:
    """The spec a checkpoint was trained with. A Hugging Face model directory has none: it gets
    one that loads it as it is, with the model's whole context window (for serving it)."""
    if is_hf_directory(checkpoint_dir):
        config = HFSpec.model_construct(path=str(checkpoint_dir), config=None).hf_config()
        window = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2048
        return JobSpec(model=HFSpec(path=str(checkpoint_dir), block_size=window), data=DataSpec(name="synthetic"))
    return JobSpec.model_validate(json.loads((Path(checkpoint_dir) / SPEC_FILE).read_text()))


# ----------------------------------------------------------------------------- formats

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
_FULL = StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=True)


def _is_deepspeed(engine: Engine) -> bool:
    """ZeRO engines wrap DeepSpeed's engine (`ds`); every other strategy is plain torch modules."""
    return getattr(engine, "ds", None) is not None


def _dcp_state(engine: Engine, options: StateDictOptions, load_optimizer: bool = True) -> list[tuple[dict, dict]]:
    parts = []
    for part, opt in zip(engine.parts, engine.optimizers):
        model_sd, optim_sd = get_state_dict(part, opt, options=options)
        parts.append((model_sd, optim_sd if load_optimizer else {}))
    return parts


def _merged(parts: list[tuple[dict, dict]]) -> dict[str, Any]:
    """One flat dict over every model part: `model.<param>` and `optim.<flattened state key>`."""
    merged: dict[str, Any] = {}
    for model_sd, optim_sd in parts:
        merged.update({f"model.{k}": v for k, v in model_sd.items()})
        merged.update({f"optim.{k}": v for k, v in optim_sd.items()})
    return merged


def _set_parts(engine: Engine, parts: list[tuple[dict, dict]], merged: dict[str, Any],
               options: StateDictOptions) -> None:
    for (model_sd, optim_sd), part, opt in zip(parts, engine.parts, engine.optimizers):
        model_state = {k: merged[f"model.{k}"] for k in model_sd}
        if not optim_sd:  # checkpoint.load_optimizer: false
            set_model_state_dict(part, model_state, options=options)
            continue
        set_state_dict(part, opt, options=options, model_state_dict=model_state,
                       optim_state_dict={k: merged[f"optim.{k}"] for k in optim_sd})


def _optimizer_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """Per-parameter state the optimizer keeps (AdamW: step and moments; SGD: momentum)."""
    if isinstance(optimizer, torch.optim.SGD):
        return ["momentum_buffer"] if optimizer.defaults["momentum"] else []
    return ["step", "exp_avg", "exp_avg_sq"]


@contextmanager
def single_process_io() -> Iterator[None]:
    """DCP warns when it reads or writes from one process without a process group; here that
    is meant (serving, export, the parameter-server driver)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a single process")
        yield


FullState = Callable[[str, str], torch.Tensor]  # (parameter name, field) -> the whole tensor


def _aliases(stored: JobSpec) -> dict[str, list[str]]:
    """Every name of each parameter (a tied weight has two; checkpoints may keep one)."""
    with torch.device("meta"):
        model = build_model(stored.model, pretrained=False)
    return {name: names for names in names_of_each_parameter(model) for name in names}


@contextmanager
def _zero_full_state(storage: RunStorage, name: str, stored: JobSpec, step: int) -> Iterator[FullState]:
    """Collective: whole tensors from a ZeRO checkpoint. AdamW state comes through DeepSpeed's
    universal checkpoint (per-parameter files); its converter knows Adam's state only, so for SGD
    the fp32 weights come from DeepSpeed's zero_to_fp32 and momentum is not carried (refused
    before any worker starts: launcher.check_resume)."""
    aliases = _aliases(stored)
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
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with storage.local_copy(name) as local:
        weights = get_fp32_state_dict_from_zero_checkpoint(str(local), tag=ZERO_DIR)

    def from_weights(fqn: str, field: str) -> torch.Tensor:
        if field != "param":
            raise KeyError(f"{storage.url(name)}: SGD momentum in a ZeRO checkpoint cannot be carried over")
        return weights[next(n for n in aliases.get(fqn, [fqn]) if n in weights)]
    yield from_weights


def _fields(key: str) -> tuple[str, str] | None:
    """(parameter name, field) of a flat state key: `model.<fqn>` or `optim.state.<fqn>.<field>`."""
    kind, _, rest = key.partition(".")
    if kind == "model":
        return rest, "param"
    if rest.startswith("state."):
        fqn, _, field = rest.removeprefix("state.").rpartition(".")
        return fqn, field
    return None  # param_groups: the running optimizer's own settings stay


class CheckpointWriteError(RuntimeError):
    """A checkpoint that storage refused (a full disk, an object store's error): the run stops
    with the storage's own error; its last committed checkpoint is untouched."""


@contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Raise a failed write as the storage's error, named. DCP reports one as a
    CheckpointException, a BaseException that `except Exception` handlers let through, holding
    each rank's error; ZeRO's files are written locally and copied up, where storage raises OSError."""
    try:
        yield
    except CheckpointException as err:
        reasons = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(err.failures.items()))
        raise CheckpointWriteError(f"checkpoint {url} could not be written ({reasons})") from None
    except OSError as err:
        raise CheckpointWriteError(f"checkpoint {url} could not be written "
                                   f"(rank {_rank()}: {type(err).__name__}: {err})") from None


class DCPFormat:
    """Every strategy but ZeRO: DCP shards keyed by full parameter names."""

    name = "dcp"

    def save(self, engine: Engine, url: str, group: dist.ProcessGroup | None) -> Future | None:
        state = dcp_layout(_merged(_dcp_state(engine, _FLAT)))
        if group is None:
            with storage_errors(url):
                dcp.save(state, checkpoint_id=url)
            return None
        return dcp.async_save(state, checkpoint_id=url, process_group=group)

    def load(self, engine: Engine, storage: RunStorage, name: str, record: dict, stored: JobSpec,
             load_optimizer: bool) -> None:
        if record["format"] == DeepSpeedFormat.name:
            self._load_zero(engine, storage, name, record, stored, load_optimizer)
            return
        parts = _dcp_state(engine, _FLAT, load_optimizer)
        merged = _merged(parts)
        dcp_load(merged, checkpoint_id=storage.url(name))
        _set_parts(engine, parts, merged, _FLAT)

    @staticmethod
    def _load_zero(engine: Engine, storage: RunStorage, name: str, record: dict, stored: JobSpec,
                   load_optimizer: bool) -> None:
        """A ZeRO checkpoint into torch modules: its whole tensors are written once per node as a
        plain DCP checkpoint in scratch space, which every rank then loads like any other (DCP
        reshards it for FSDP, tensor and pipeline parts). The running optimizer keeps its settings."""
        parts = _dcp_state(engine, _FLAT, load_optimizer)
        merged = _merged(parts)
        fields = sorted({where[1] for key in merged if (where := _fields(key)) and where[1] != "param"})
        with _zero_full_state(storage, name, stored, record["step"]) as full, _node_scratch() as (scratch, leader):
            if leader:
                _write_whole(full, stored, fields, scratch / "whole")
            _barrier()
            tensors = {key: value for key, value in merged.items() if _fields(key) is not None}
            dcp_load(tensors, checkpoint_id=str(scratch / "whole"))
            _barrier()  # before the leader's scratch space goes
        merged.update(tensors)
        _set_parts(engine, parts, merged, _FLAT)


def _write_whole(full: FullState, stored: JobSpec, fields: list[str], directory: Path) -> None:
    """Every parameter (under each of its names) and its optimizer `fields` as one process's DCP
    checkpoint."""
    with torch.device("meta"):
        model = build_model(stored.model, pretrained=False)
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

    def save(self, engine: Engine, url: str, group: dist.ProcessGroup | None) -> None:
        from deepspeed.checkpoint.constants import (
            UNIVERSAL_CHECKPOINT_INFO,
            UNIVERSAL_CHECKPOINT_VERSION_KEY,
            UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        )

        # The universal-checkpoint marker lets DeepSpeed's converter reshard this checkpoint later
        # (stages 1 and 2 refuse to convert without it); a model with no tensor-parallel slicing
        # needs nothing else in it.
        info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
        storage = RunStorage(url)
        with storage_errors(url), _writable_local(storage) as local:  # the local copy goes either way
            engine.ds.save_checkpoint(str(local), tag=ZERO_DIR, client_state={UNIVERSAL_CHECKPOINT_INFO: info})
        return None

    def load(self, engine: Engine, storage: RunStorage, name: str, record: dict, stored: JobSpec,
             load_optimizer: bool) -> None:
        if record["format"] == DCPFormat.name:
            self._load_full_state(engine, self._from_dcp(engine, storage.url(name), load_optimizer), load_optimizer)
        elif record["world_size"] == dist.get_world_size():
            with storage.local_copy(name) as local:
                loaded_from, _ = engine.ds.load_checkpoint(str(local), tag=ZERO_DIR,
                                                           load_optimizer_states=load_optimizer)
            if loaded_from is None:  # DeepSpeed warns and carries on when it finds nothing
                raise FileNotFoundError(f"no ZeRO checkpoint under {storage.url(name, ZERO_DIR)}")
        else:  # resharded through whole tensors (DeepSpeed's universal checkpoint's files)
            with _zero_full_state(storage, name, stored, record["step"]) as full:
                self._load_full_state(engine, full, load_optimizer and stored.optim.name == "adamw")

    @staticmethod
    def _from_dcp(engine: Engine, url: str, load_optimizer: bool) -> FullState:
        """Every rank reads the whole tensors it needs from a DCP checkpoint."""
        shapes = {n: getattr(p, "ds_shape", p.shape) for n, p in engine.ds.module.named_parameters()}
        fields = _optimizer_state_keys(engine.optimizers[0]) if load_optimizer else []
        wanted = {f"model.{n}": torch.empty(s) for n, s in shapes.items()}
        wanted |= {f"optim.state.{n}.{f}": torch.empty(() if f == "step" else s) for n, s in shapes.items()
                   for f in fields}
        dcp.load(wanted, checkpoint_id=url)
        return lambda fqn, field: wanted[f"model.{fqn}" if field == "param" else f"optim.state.{fqn}.{field}"]

    @staticmethod
    def _load_full_state(engine: Engine, full: FullState, load_optimizer: bool) -> None:
        """Whole tensors into ZeRO: DeepSpeed's public `safe_set_full_*` API puts each rank's
        partition in place, in the fp32 master copy and the optimizer state."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        stage3 = engine.ds.zero_optimization_stage() == 3
        fields = _optimizer_state_keys(engine.optimizers[0]) if load_optimizer else []
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


def format_for(engine: Engine) -> DCPFormat | DeepSpeedFormat:
    return DeepSpeedFormat() if _is_deepspeed(engine) else DCPFormat()


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


def _universal_tensor(universal: Path, fqn: str, field: str) -> torch.Tensor:
    value = torch.load(universal / fqn / f"{field}.pt", weights_only=False)
    return value["param"] if isinstance(value, dict) else value


@contextmanager
def _universal(storage: RunStorage, name: str) -> Iterator[Path]:
    """Collective: DeepSpeed's universal checkpoint of ZeRO checkpoint `name` (whole per-parameter
    tensors under its `zero/`), converted once per node into node-local scratch space, removed
    after."""
    from deepspeed.checkpoint import ds_to_universal

    with _node_scratch() as (scratch, leader):
        if leader:
            with storage.local_copy(name) as local:
                ds_to_universal.main(Namespace(
                    input_folder=str(local / ZERO_DIR), output_folder=str(scratch / "universal"),
                    num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                    inject_missing_state=False))
        _barrier()
        yield scratch / "universal"
        _barrier()


@contextmanager
def _node_scratch() -> Iterator[tuple[Path, bool]]:
    """Collective: a temporary directory shared by the ranks of this node (the node's first rank
    owns it and removes it afterwards), and whether this rank is that first rank."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if dist.is_initialized() else 0
    with tempfile.TemporaryDirectory(prefix="shardyard-scratch-") as mine:
        scratch = Path(mine)
        if dist.is_initialized():
            everyones: list[str] = [""] * dist.get_world_size()
            dist.all_gather_object(everyones, mine)
            # Ray Train and torchrun number ranks node by node: the node's first is rank - local_rank.
            scratch = Path(everyones[dist.get_rank() - local_rank])
        yield scratch, local_rank == 0


# ----------------------------------------------------------------------------- the manager


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class CheckpointManager:
    """Saves, commits, prunes and restores a run's checkpoints. `save` and `restore` are
    collective over the engine's ranks.

    `writer`: whether this process writes checkpoints (under hot recovery only one replica does:
    every replica holds the whole state, in a process group of its own). `asynchronous`: DCP
    copies the state to memory and writes it in a background thread over a process group of its
    own while training goes on; the checkpoint commits when the write is done (ZeRO writes
    synchronously). One write at a time. `on_commit(name, metrics)` runs on every writing rank
    once a checkpoint is committed (the launcher tells Ray Train there).
    """

    def __init__(self, run_dir: str | Path, keep: int, *, asynchronous: bool = False, writer: bool = True,
                 load_optimizer: bool = True,
                 on_commit: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.storage = RunStorage(run_dir)
        self.keep = keep
        self.asynchronous = asynchronous
        self.writer = writer
        self.load_optimizer = load_optimizer
        self.on_commit = on_commit
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[str, Future | None, dict[str, Any]] | None = None

    # -- restore

    def restore(self, engine: Engine) -> TrainState | None:
        """Collective: load the newest committed checkpoint, if any. Directories that no commit
        record ever completed are deleted first (no worker group is writing now)."""
        if self.writer and _rank() == 0:
            self._delete_uncommitted(before=None)
        _barrier()
        name = self.storage.newest_committed()
        return self.load(engine, name) if name else None

    def load(self, engine: Engine, name: str) -> TrainState:
        with holding(self.storage.uri, name):  # not pruned under this rank while it reads
            return self._load(engine, name)

    def _load(self, engine: Engine, name: str) -> TrainState:
        record = self.storage.committed(name)
        if record is None:
            raise FileNotFoundError(f"checkpoint {self.storage.url(name)} is not committed")
        meta = torch.load(io.BytesIO(self.storage.read_bytes(name, STATE_FILE)), weights_only=True)
        stored = JobSpec.model_validate_json(self.storage.read_bytes(name, SPEC_FILE))
        with single_process_io():
            format_for(engine).load(engine, self.storage, name, record, stored, self.load_optimizer)
        scheduler_state = meta.pop("scheduler")
        for scheduler in engine.schedulers:
            # The schedule resumes at its step, with this spec's optim.lr (the stored base rate
            # would silently override a changed one).
            base_lrs = list(scheduler.base_lrs)
            scheduler.load_state_dict(scheduler_state)
            scheduler.base_lrs = base_lrs
            # A restored schedule sets the learning rate only at its next step; the step about
            # to run needs it now (formats that do not carry the optimizer's settings, and
            # `load_optimizer: false`, would otherwise train one step at the stored rate).
            for group, base, factor in zip(scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
                group["lr"] = base * factor(scheduler.last_epoch)
        return TrainState(**meta)

    # -- save

    def save(self, engine: Engine, state: TrainState, spec: JobSpec, metrics: dict[str, Any]) -> None:
        """Collective over the writing ranks: write this step's checkpoint; commit it now, or
        (asynchronous) once its background write is done."""
        if not self.writer:
            return
        self.wait()
        name = checkpoint_name(state.step)
        if self.storage.committed(name) is not None:
            # This step's state is in storage already (an earlier attempt committed it): deleting
            # it to write it again would lose it to a crash in between. Every rank reads the same.
            return
        fmt = format_for(engine)
        if _rank() == 0:
            # Left by a write that a failure cut short: the step is written again from scratch.
            self.storage.delete(name)
            self.storage.write_bytes(spec.model_dump_json(indent=2).encode(), name, SPEC_FILE)
        _barrier()  # no rank writes into the directory before it is fresh
        group = None
        if self.asynchronous and fmt.name == DCPFormat.name and dist.is_initialized():
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            group = self._group
        with single_process_io():
            future = fmt.save(engine, self.storage.url(name), group)
        if _rank() == 0:
            buffer = io.BytesIO()
            torch.save({**asdict(state), "scheduler": engine.schedulers[0].state_dict()}, buffer)
            self.storage.write_bytes(buffer.getvalue(), name, STATE_FILE)
        record = {"step": state.step, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                  "format": fmt.name}
        self._pending = (name, future, {"record": record, "metrics": metrics})
        if future is None:
            self.wait()

    def wait(self) -> None:
        """Finish the pending write, if any: wait for it (its error is raised here), commit it."""
        if self._pending is None:
            return
        name, future, info = self._pending
        self._pending = None
        if future is None:
            _barrier()  # every rank's state is written
        else:
            with storage_errors(self.storage.url(name)):  # a background write's error surfaces here
                future.result()  # rank 0's completes once every rank's is written (DCP's metadata)
        if _rank() == 0:
            record = {**info["record"], "time": time.time()}
            self.storage.write_bytes(json.dumps(record).encode(), name, COMMIT_FILE)
            self._prune(newest=name)
        if self.on_commit is not None:
            self.on_commit(self.storage.url(name), info["metrics"])

    def close(self) -> None:
        self.wait()

    # -- pruning

    def _prune(self, newest: str) -> None:
        """Keep the newest `keep` committed checkpoints; drop older ones and every uncommitted
        directory older than `newest` (crashed writes)."""
        names = self.storage.checkpoint_names()
        committed = [n for n in names if self.storage.exists(n, COMMIT_FILE)]
        uncommitted = [n for n in names if n < newest and n not in committed]
        for name in committed[:-self.keep] + uncommitted:
            holders = live_holds(self.storage, name)
            if holders:  # pruned at a later commit, once its readers are done
                print(f"shardyard: keeping {self.storage.url(name)} for now: read by "
                      + ", ".join(f"host {h['host']} pid {h['pid']}" for h in holders), flush=True)
                continue
            self.storage.delete(name)

    def _delete_uncommitted(self, before: str | None) -> None:
        for name in self.storage.checkpoint_names():
            if (before is None or name < before) and not self.storage.exists(name, COMMIT_FILE):
                self.storage.delete(name)


# ----------------------------------------------------------------------------- one process


def load_model(checkpoint_dir: str | Path) -> nn.Module:
    """Rebuild the trained model in one process from any committed checkpoint, whatever strategy
    and world size wrote it (DCP reads every shard itself)."""
    checkpoint_dir = Path(checkpoint_dir)
    if is_hf_directory(checkpoint_dir):
        return build_model(read_spec(checkpoint_dir).model)  # its own pretrained weights
    record = committed_record(checkpoint_dir)
    if record is None:
        raise FileNotFoundError(f"{checkpoint_dir} is not a committed checkpoint")
    model = build_model(read_spec(checkpoint_dir).model, pretrained=False)  # the checkpoint has the weights
    if record["format"] == DeepSpeedFormat.name:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=ZERO_DIR)
        # DeepSpeed saves a tied weight once, under one of its names; any other gap is an error.
        every = dict(model.named_parameters(remove_duplicate=False))
        aliases = set(every) - set(dict(model.named_parameters()))
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys or set(result.missing_keys) - aliases:
            raise KeyError(f"ZeRO checkpoint {checkpoint_dir} does not match the model: missing "
                           f"{sorted(set(result.missing_keys) - aliases)}, unexpected {result.unexpected_keys}")
        return model
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    with single_process_io():
        dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return model


def load_model_part(checkpoint_dir: str | Path, part: Callable[[nn.Module], nn.Module], device: torch.device,
                    collective: bool = False) -> nn.Module:
    """What `part` makes of a checkpoint's model (a pipeline stage, the model sharded for tensor
    parallelism), reading only that part's tensors or slices: the model is built on the meta
    device, `part` taken from it, given storage on `device`, and the checkpoint (DCP) or the
    model directory (its safetensors) fills it. `collective`: every rank of the current process
    group loads its own part at once (tensor-parallel slices). A ZeRO checkpoint is read through
    DeepSpeed's converter in its lazy mode (`_fill_from_zero`). A custom module (its buffers are
    unknown here) loads whole first."""
    checkpoint_dir = Path(checkpoint_dir)
    stored = read_spec(checkpoint_dir)
    spec = stored.model
    hf_directory = is_hf_directory(checkpoint_dir)
    record = None if hf_directory else committed_record(checkpoint_dir)
    if isinstance(spec, CustomSpec):
        return part(load_model(checkpoint_dir).to(device))
    with torch.device("meta"):  # shapes; a model directory's weights are read once split
        piece = part(build_model(spec, pretrained=hf_directory))
    if hf_directory:
        return materialise(piece, device)
    if record is None:
        raise FileNotFoundError(f"{checkpoint_dir} is not a committed checkpoint")
    give_storage(piece, device)
    if record["format"] == DeepSpeedFormat.name:
        _fill_from_zero(piece, checkpoint_dir, stored)
        return piece
    state = {f"model.{k}": v for k, v in piece.state_dict().items()}
    if collective:
        dcp_load(state, checkpoint_id=str(checkpoint_dir))
    else:
        with single_process_io():
            dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    piece.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return piece


def _fill_from_zero(piece: nn.Module, checkpoint_dir: Path, stored: JobSpec) -> None:
    """Each tensor `piece` holds (its slice, when sharded) from a ZeRO checkpoint, through
    DeepSpeed's converter in lazy mode: it maps the ranks' partition files, and a ZeRO-3
    checkpoint's parameters are gathered one at a time, only those asked for. (ZeRO-1/2 files
    hold flat groups the converter joins whole: those weights pass through host memory once; the
    model held them whole on every training rank too.)"""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=ZERO_DIR, lazy_mode=True)
    aliases = _aliases(stored)  # DeepSpeed saves a tied weight once, under one of its names
    for name, target in piece.state_dict(keep_vars=True).items():
        saved_as = next((n for n in aliases.get(name, [name]) if n in lazy), None)
        if saved_as is None:
            raise KeyError(f"ZeRO checkpoint {checkpoint_dir} holds no '{name}'")
        copy_local(target, lazy[saved_as].contiguous())


def export_safetensors(checkpoint_dir: str | Path, out: str | Path) -> Path:
    """One plain state_dict file from a checkpoint of any strategy, loadable in one process."""
    from safetensors.torch import save_model

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model(load_model(checkpoint_dir), str(out))  # save_model handles tied weights
    return out
