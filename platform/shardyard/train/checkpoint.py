"""Checkpoints: what is saved, where it goes, and how a run finds and restores the latest one.

Model and optimizer state go through `torch.distributed.checkpoint` (DCP): every rank writes its
own shard, and loading reshards to whatever world size is running now. Keys are the full model's
parameter names (optimizer state flattened under them), whatever the strategy: DDP, FSDP, tensor
and pipeline checkpoints share one layout. ZeRO state goes through DeepSpeed's engine instead
(zero.py), resharded through DeepSpeed's universal checkpoint format. Beside the shards rank 0
writes the trainer state (step, data position, LR schedule) and the job spec, so one checkpoint
directory is enough to resume training or to rebuild the model for serving.

Ray Train owns persistence: each rank hands its local directory to `ray.train.report`, Ray merges
them into one checkpoint directory under `<storage_path>/<run.name>/` and keeps the newest
`checkpoint.keep`. Each rank marks its shard done once it is in storage; a checkpoint is complete
when every rank's marker is there, and a restart resumes from the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import CheckpointUploadMode
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardyard.models import build_model
from shardyard.parallel import Engine
from shardyard.spec import JobSpec

STATE_FILE = "trainer_state.pt"
SPEC_FILE = "spec.json"
DIR_PREFIX = "checkpoint_step_"


@dataclass
class TrainState:
    step: int = 0          # optimizer steps completed
    samples_seen: int = 0  # global position in the sample order (see data/sampler.py)
    world_size: int = 1    # world size that wrote the checkpoint


ZERO_DIR = "zero"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _part_states(engine: Engine) -> list[tuple[dict, dict]]:
    return [get_state_dict(part, opt, options=_FLAT) for part, opt in zip(engine.parts, engine.optimizers)]


def _merged(parts: list[tuple[dict, dict]]) -> dict[str, Any]:
    """One flat dict over every model part: `model.<param>` and `optim.<flattened state key>`."""
    merged: dict[str, Any] = {}
    for model_sd, optim_sd in parts:
        merged.update({f"model.{k}": v for k, v in model_sd.items()})
        merged.update({f"optim.{k}": v for k, v in optim_sd.items()})
    return merged


def save(engine: Engine, state: TrainState, spec: JobSpec, directory: Path, rank: int) -> None:
    """Collective: every rank must call it. Writes this rank's shard into `directory`."""
    if engine.checkpoint_format == "deepspeed":
        engine.save_checkpoint(directory, ZERO_DIR)
    else:
        dcp.save(_merged(_part_states(engine)), checkpoint_id=str(directory))
    _save_trainer_state(engine, state, spec, directory, rank)


def _save_trainer_state(engine: Engine, state: TrainState, spec: JobSpec, directory: Path, rank: int) -> None:
    if rank == 0:
        torch.save({**asdict(state), "scheduler": engine.schedulers[0].state_dict()}, directory / STATE_FILE)
        (directory / SPEC_FILE).write_text(spec.model_dump_json(indent=2))


def load(engine: Engine, directory: Path) -> TrainState:
    """Collective: restore model, optimizer and schedule; returns where training stopped."""
    meta = torch.load(directory / STATE_FILE, weights_only=True)
    if engine.checkpoint_format == "deepspeed":
        engine.load_checkpoint(directory, ZERO_DIR, resharded=meta["world_size"] != engine.dp_size)
    else:
        parts = _part_states(engine)
        merged = _merged(parts)
        dcp.load(merged, checkpoint_id=str(directory))
        for (model_sd, optim_sd), part, opt in zip(parts, engine.parts, engine.optimizers):
            set_state_dict(part, opt, options=_FLAT,
                           model_state_dict={k: merged[f"model.{k}"] for k in model_sd},
                           optim_state_dict={k: merged[f"optim.{k}"] for k in optim_sd})
    scheduler_state = meta.pop("scheduler")
    for scheduler in engine.schedulers:
        scheduler.load_state_dict(scheduler_state)
    return TrainState(**meta)


def restore_latest(engine: Engine, run_dir: Path) -> TrainState | None:
    """Collective: resume from the newest complete checkpoint of the run, if any.

    Newest complete, not the one Ray Train hands back: Ray registers a checkpoint only when its
    controller next polls the workers (every `scaling.health_check_interval_s`), so a failure soon
    after a checkpoint would otherwise cost a whole interval more, and a report still queued on a
    dead worker is never registered at all. Replicated-state engines write in place (see
    CheckpointWriter)."""
    if engine.replicated_state:
        latest = find_latest(run_dir)
        return load(engine, latest) if latest else None
    storage = ray.train.get_context().get_storage()
    fs, run_path = storage.storage_filesystem, storage.experiment_fs_path
    newest = newest_complete(fs, run_path)
    if newest is None:
        return None
    if dist.get_rank() == 0:
        prune_unregistered(fs, run_path, older_than=newest)
    with ray.train.Checkpoint(f"{run_path}/{newest}", fs).as_directory() as directory:
        return load(engine, Path(directory))


class CheckpointWriter:
    """Saves checkpoints and hands them to Ray Train. Collective: every rank calls `report` at the
    same steps.

    Ray Train copies each rank's directory into the checkpoint directory in storage; then the
    rank writes `shard_<rank>_of_<world size>.done` beside it. A crash in between leaves a partial
    directory, lacking a marker, that is never restored from.

    With `asynchronous`, training goes on while the checkpoint is written: DCP copies the state
    to CPU memory and serialises it in a background thread (over a process group of its own, so
    its collectives never interleave with training's), and Ray Train uploads it in a background
    thread of its own once that is done (CheckpointUploadMode.ASYNC). DeepSpeed writes ZeRO
    state synchronously, so there only the upload is asynchronous. One DCP write at a time.

    Replicated-state engines (hot recovery) do not report: `ray.train.report` is a barrier over
    every worker, which survivors cannot wait on while a replica is being replaced. Rank 0 writes
    the whole state into a hidden directory of the run and renames it into place (atomic on a
    filesystem), then prunes to `checkpoint.keep`.
    """

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self._group: dist.ProcessGroup | None = None
        self._writing: Future | None = None

    def report(self, metrics: dict[str, Any], engine: Engine, state: TrainState, spec: JobSpec,
               rank: int, crash_before_upload: bool = False) -> None:
        """`crash_before_upload` injects a crash: this rank dies after saving its shard, before
        uploading it, while the others upload theirs."""
        name = f"{DIR_PREFIX}{state.step:08d}"
        if engine.replicated_state:
            if rank == 0:
                write_in_place(engine, state, spec, name)
            return
        storage = ray.train.get_context().get_storage()
        if rank == 0:
            # Left by a write that a failure cut short: the step is written again from scratch.
            # Before the report's barrier, so before any rank uploads.
            _delete_if_present(storage.storage_filesystem, storage.build_checkpoint_path_from_name(name))
        directory = Path(tempfile.mkdtemp(prefix="shardyard-ckpt-"))  # Ray deletes it after upload
        writing: Future | None = None
        if engine.checkpoint_format == "deepspeed" or not self.asynchronous:
            save(engine, state, spec, directory, rank)
        else:
            if self._writing is not None:
                self._writing.result()
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            writing = self._writing = dcp.async_save(_merged(_part_states(engine)),
                                                     checkpoint_id=str(directory), process_group=self._group)
            _save_trainer_state(engine, state, spec, directory, rank)
        done_marker = _shard_done(rank, dist.get_world_size())

        def upload(checkpoint: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
            if crash_before_upload:
                os.kill(os.getpid(), signal.SIGKILL)
            if writing is not None:
                writing.result()
            persisted = storage.persist_current_checkpoint(checkpoint, dir_name)
            with persisted.filesystem.open_output_stream(f"{persisted.path}/{done_marker}"):
                pass  # this rank's shard is in storage
            return persisted

        mode = CheckpointUploadMode.ASYNC if self.asynchronous else CheckpointUploadMode.SYNC
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                         checkpoint_dir_name=name, checkpoint_upload_mode=mode, checkpoint_upload_fn=upload,
                         delete_local_checkpoint_after_upload=True)


def write_in_place(engine: Engine, state: TrainState, spec: JobSpec, name: str,
                   also: Callable[[Path], None] | None = None) -> Path:
    """One process writes the whole checkpoint (and whatever `also` adds to the directory) into a
    hidden directory of the run, renames it into place (atomic on a filesystem), then prunes."""
    run_dir = Path(spec.run_dir)
    partial, final = run_dir / f".{name}.partial", run_dir / name
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save(engine, state, spec, partial, rank=0)
    if also is not None:
        also(partial)
    mark_shard_done(partial, rank=0, world_size=1)
    shutil.rmtree(final, ignore_errors=True)  # the same step written again after a restart
    partial.rename(final)
    for old in sorted(run_dir.glob(f"{DIR_PREFIX}*"))[:-spec.checkpoint.keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _shard_done(rank: int, world_size: int) -> str:
    """Marker a rank writes into the checkpoint directory once its shard is in storage."""
    return f"shard_{rank}_of_{world_size}.done"


def mark_shard_done(directory: Path, rank: int, world_size: int) -> None:
    """For checkpoints written straight into their final directory (not through Ray Train):
    this rank's shard is complete."""
    (directory / _shard_done(rank, world_size)).touch()


_SHARD_DONE = re.compile(r"shard_(\d+)_of_(\d+)\.done")


def _every_shard_done(names: list[str]) -> bool:
    marks = [m for m in map(_SHARD_DONE.fullmatch, names) if m]
    world_sizes = {int(m[2]) for m in marks}
    return len(world_sizes) == 1 and {int(m[1]) for m in marks} == set(range(world_sizes.pop()))


def _listing(fs: pyarrow.fs.FileSystem, path: str) -> list[pyarrow.fs.FileInfo]:
    return fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))


def _checkpoint_dirs(fs: pyarrow.fs.FileSystem, run_path: str) -> list[str]:
    return sorted(info.base_name for info in _listing(fs, run_path)
                  if info.type == pyarrow.fs.FileType.Directory and info.base_name.startswith(DIR_PREFIX))


def newest_complete(fs: pyarrow.fs.FileSystem, run_path: str) -> str | None:
    """Name of the run's newest checkpoint that every rank finished writing. A directory that a
    crash left half-written lacks some rank's marker and is never chosen."""
    for name in reversed(_checkpoint_dirs(fs, run_path)):  # newest first: stop at the first found
        if _every_shard_done([info.base_name for info in _listing(fs, f"{run_path}/{name}")]):
            return name
    return None


def find_latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run in a local or shared directory."""
    run_dir = Path(run_dir).absolute()
    name = newest_complete(pyarrow.fs.LocalFileSystem(), str(run_dir))
    return run_dir / name if name else None


def _delete_if_present(fs: pyarrow.fs.FileSystem, path: str) -> None:
    if fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound:
        fs.delete_dir(path)


SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train's list of registered checkpoints


def prune_unregistered(fs: pyarrow.fs.FileSystem, run_path: str, older_than: str) -> None:
    """Deletes checkpoint directories older than `older_than` that Ray Train never registered
    (a failure came before its controller did): Ray prunes only those it knows. Safe only while
    no worker group is writing: at the start of one, and once the run has ended."""
    snapshot, registered = f"{run_path}/{SNAPSHOT_FILE}", set()
    if fs.get_file_info(snapshot).type == pyarrow.fs.FileType.File:
        with fs.open_input_stream(snapshot) as stream:
            registered = {r["checkpoint_dir_name"] for r in json.loads(stream.read())["checkpoint_results"]}
    for name in _checkpoint_dirs(fs, run_path):
        if name < older_than and name not in registered:
            fs.delete_dir(f"{run_path}/{name}")


def read_spec(checkpoint_dir: str | Path) -> JobSpec:
    return JobSpec.model_validate(json.loads((Path(checkpoint_dir) / SPEC_FILE).read_text()))


def load_model(checkpoint_dir: str | Path) -> nn.Module:
    """Rebuild the trained model in one process from any checkpoint, whatever world size wrote it
    (with no_dist, DCP reads every shard itself)."""
    checkpoint_dir = Path(checkpoint_dir)
    model = build_model(read_spec(checkpoint_dir).model)
    if (checkpoint_dir / ZERO_DIR).is_dir():
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
    with warnings.catch_warnings():
        # DCP warns that it assumes a single-process load even when told so with no_dist.
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return model


def export_safetensors(checkpoint_dir: str | Path, out: str | Path) -> Path:
    """One plain state_dict file from a checkpoint of any strategy, loadable in one process."""
    from safetensors.torch import save_model

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_model(load_model(checkpoint_dir), str(out))  # save_model handles tied weights
    return out
