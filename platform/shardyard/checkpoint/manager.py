"""Checkpoints: one `CheckpointManager` for every strategy, recovery mode and storage.

The manager knows no strategy (the shape of TorchTitan's): the engine names its format (`dcp` or
`deepspeed`), and the format writes and reads the model and optimizer state. What the manager
owns is the life of a checkpoint (layout.py, record.py):

1. rank 0 writes `spec.json`; every rank writes its part through the format, each file
   checksummed as it is written (DCP) and fsynced;
2. once every rank's write is done, rank 0 gathers the ranks' file lists, makes every file and
   the directory durable, checks that this launch still holds the run (`fence`), and writes the
   commit record last: the checkpoint exists from that moment, never half;
3. rank 0 prunes older checkpoints (only names the run writes, never one a reader holds, never
   the newest good one), again only while it holds the run.

A restore loads the newest good checkpoint: records and files are verified on rank 0, and a
torn, empty or corrupted one is named in a warning and passed over for the one before it.
Everything goes straight to the run's storage through fsspec: a local or shared path, or an
object store URI. Ray Train is told nothing about checkpoints: the commit records alone say
which a run has.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from shardyard.checkpoint.collective import Written, barrier, rank, single_process_io, world_size, storage_errors
from shardyard.checkpoint.dcp_format import DCPFormat
from shardyard.checkpoint.generations import Lineage
from shardyard.checkpoint.layout import SPEC_FILE, STATE_FILE, TrainState, stored_spec
from shardyard.checkpoint.lease import LeaseFence, LeaseLost
from shardyard.checkpoint.reader_holds import HoldWatch, holding, live_holds
from shardyard.checkpoint.record import (
    BadCheckpoint,
    CommitRefused,
    FileEntry,
    checkpoint_name,
    committed,
    entry,
    make_record,
    newest_good,
    read_record,
    write_record,
)
from shardyard.checkpoint.store import RunStorage
from shardyard.checkpoint.verified_reads import check_entry
from shardyard.checkpoint.zero_format import DeepSpeedFormat
from shardyard.parallel import Engine
from shardyard.spec import JobSpec

log = logging.getLogger("shardyard")


class CheckpointFormat(Protocol):
    name: str

    def save(self, engine: Engine, storage: RunStorage, name: str, group: dist.ProcessGroup | None) -> Written: ...

    def load(self, engine: Engine, storage: RunStorage, name: str, record: dict, stored: JobSpec,
             load_optimizer: bool) -> None: ...


FORMATS: dict[str, CheckpointFormat] = {f.name: f for f in (DCPFormat(), DeepSpeedFormat())}

Fence = LeaseFence  # raises when this launch no longer holds the run (checkpoint/lease.py)


class CheckpointManager:
    """Saves, commits, prunes and restores a run's checkpoints. `save` and `restore` are
    collective over the engine's ranks.

    `writer`: whether this process writes checkpoints (under hot recovery only one replica does:
    every replica holds the whole state, in a process group of its own). `asynchronous`: DCP
    copies the state to memory and writes it in a background thread over a process group of its
    own while training goes on; the checkpoint commits when the write is done (ZeRO writes
    synchronously). One write at a time. `fence`: checked on rank 0 before every commit and
    prune; it raises (LeaseLost) once another launch holds the run, and nothing more is written.
    `spec`: the spec this process was launched with; a checkpoint's stored spec is read as data
    and its model section replaced by this one (the model cannot change on resume), so no code a
    run directory names is imported.
    """

    def __init__(self, run_dir: str | Path, keep: int, *, asynchronous: bool = False, writer: bool = True,
                 load_optimizer: bool = True, fence: Fence | None = None, spec: JobSpec | None = None) -> None:
        self.storage = RunStorage(run_dir)
        self.keep = keep
        self.asynchronous = asynchronous
        self.writer = writer
        self.load_optimizer = load_optimizer
        self.fence = fence
        # Written into each record: the launch's lease generation. A manager without a fence (a
        # local tool, a test driving ranks itself) commits as the run's current holder would.
        self.generation = fence.generation if fence is not None else None
        self.spec = spec
        self._holds = HoldWatch()  # what this pruner has seen of readers' holds, by its own clock
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[str, Written, dict[str, Any], dict[str, FileEntry]] | None = None
        # The last restore's phases on this rank: choosing a good checkpoint (rank 0 reads the
        # records and checks each file's size and checksum) and loading it.
        self.restore_timings: dict[str, float] = {}

    # -- restore

    def restore(self, engine: Engine) -> TrainState | None:
        """Collective: load the newest good checkpoint, if any. Rank 0 chooses it (a valid record,
        every file there at its size; a DCP checkpoint's checksums are checked as its files are
        read, another format's here), passing over bad ones with a warning; one found bad while
        loading is passed over too, and the next older one loaded. As the writer, rank 0 first
        deletes directories that no commit record completed (no worker group is writing now), and
        sets aside the bad ones newer than the one loaded."""
        if self.writer:
            self._fenced_everywhere()
        if rank() == 0 and self.writer:
            self._delete_uncommitted()
        failed: list[str] = []
        self.restore_timings = {"verify_s": 0.0, "load_s": 0.0}
        while True:
            choosing = time.perf_counter()
            chosen: list[str | None] = [None]
            if rank() == 0:
                found = newest_good(self.storage, passing_over=failed,
                                    checksums=lambda record: record["format"] != DCPFormat.name)
                chosen[0] = found[0] if found else None
            if dist.is_initialized():
                dist.broadcast_object_list(chosen, src=0)
            loading = time.perf_counter()
            self.restore_timings["verify_s"] += loading - choosing
            if chosen[0] is None:
                state = None
                break
            try:
                state = self.load(engine, chosen[0])
                break
            except BadCheckpoint as err:  # raised on every rank alike (read_dcp gathers them)
                failed.append(chosen[0])
                if rank() == 0:
                    log.warning("checkpoint %s failed verification while loading (%s); falling back to an older one",
                                self.storage.url(chosen[0]), err)
            finally:
                self.restore_timings["load_s"] += time.perf_counter() - loading
        if rank() == 0 and self.writer:
            self._set_aside_bad(after=chosen[0])
        return state

    def load(self, engine: Engine, name: str) -> TrainState:
        with holding(self.storage.uri, name):  # not pruned under this rank while it reads
            return self._load(engine, name)

    def _load(self, engine: Engine, name: str) -> TrainState:
        record = read_record(self.storage, name)
        if record is None:
            raise BadCheckpoint(f"checkpoint {self.storage.url(name)} is not committed")
        meta = torch.load(io.BytesIO(self._read_checked(name, record, STATE_FILE)), weights_only=True)
        stored = stored_spec(self._read_checked(name, record, SPEC_FILE))
        if self.spec is not None:  # the launched model: never a factory named by the stored file
            stored = stored.model_copy(update={"model": self.spec.model})
        with single_process_io():
            FORMATS[engine.checkpoint_format].load(engine, self.storage, name, record, stored, self.load_optimizer)
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

    def _read_checked(self, name: str, record: dict[str, Any], relative: str) -> bytes:
        data = self.storage.read_bytes(name, relative)
        check_entry(data, record["files"].get(relative), self.storage.url(name, relative))
        return data

    # -- save

    def save(self, engine: Engine, state: TrainState, spec: JobSpec) -> None:
        """Collective over the writing ranks: write this step's checkpoint; commit it now, or
        (asynchronous) once its background write is done."""
        if not self.writer:
            return
        self.wait()
        name = checkpoint_name(state.step)
        already: list[bool] = [False]
        if rank() == 0:
            already[0] = self._committed(name)
        if dist.is_initialized():
            dist.broadcast_object_list(already, src=0)
        if already[0]:
            # This step's state is in storage already (an earlier attempt committed it): deleting
            # it to write it again would lose it to a crash in between.
            return
        fmt = FORMATS[engine.checkpoint_format]
        own: dict[str, FileEntry] = {}
        self._fenced_everywhere()
        if rank() == 0:
            # Left by a write that a failure cut short: the step is written again from scratch.
            self.storage.delete(name)
            spec_json = spec.model_dump_json(indent=2).encode()
            self.storage.write_bytes(spec_json, name, SPEC_FILE)
            own[SPEC_FILE] = entry(spec_json)
        barrier()  # no rank writes into the directory before it is fresh
        group = None
        if self.asynchronous and fmt.name == DCPFormat.name and dist.is_initialized():
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            group = self._group
        with single_process_io():
            written = fmt.save(engine, self.storage, name, group)
        if rank() == 0:
            buffer = io.BytesIO()
            torch.save({**asdict(state), "scheduler": engine.schedulers[0].state_dict()}, buffer)
            self.storage.write_bytes(buffer.getvalue(), name, STATE_FILE)
            own[STATE_FILE] = entry(buffer.getvalue())
        record = {"step": state.step, "world_size": world_size(), "format": fmt.name}
        self._pending = (name, written, record, own)
        if written.future is None:
            self.wait()

    def wait(self) -> None:
        """Collective: finish the pending write, if any: wait for it (its error is raised here),
        gather every rank's file list, commit it, prune."""
        if self._pending is None:
            return
        name, written, record, own = self._pending
        self._pending = None
        if written.future is None:
            barrier()  # every rank's state is written
        else:
            with storage_errors(self.storage.url(name)):  # a background write's error surfaces here
                written.future.result()
        files = {**written.files(), **own}
        everyone: list[dict[str, FileEntry]] | None = [{}] * world_size() if rank() == 0 else None
        if dist.is_initialized():
            dist.gather_object(files, everyone, dst=0)
        else:
            everyone = [files]
        self._fenced_everywhere()
        refused: list[str | None] = [None]
        if rank() == 0:
            listed = {path: item for part in everyone for path, item in part.items()}
            try:
                write_record(self.storage, name, make_record(record["step"], record["world_size"], record["format"],
                                                             listed, time.time(), self._writing_generation()))
            except CommitRefused as err:  # another launch committed this step: it holds the run
                refused[0] = str(err)
            else:
                self._prune(newest=name)
        if dist.is_initialized():
            dist.broadcast_object_list(refused, src=0)
        if refused[0] is not None:
            raise LeaseLost(refused[0])

    def close(self) -> None:
        self.wait()

    def _writing_generation(self) -> int:
        return self.generation if self.generation is not None else Lineage.of(self.storage).generation

    def _fenced_everywhere(self) -> None:
        """Collective: rank 0 checks that this launch still holds the run; if not, every rank
        raises LeaseLost (together, so no rank waits in a collective the others left)."""
        if self.fence is None:
            return
        lost: list[str | None] = [None]
        if rank() == 0:
            try:
                self.fence()
            except LeaseLost as err:
                lost[0] = str(err)
            except OSError as err:  # unsure whether it still holds the run: it writes nothing
                lost[0] = f"the run's lease could not be read ({type(err).__name__}: {err}); nothing is written"
        if dist.is_initialized():
            dist.broadcast_object_list(lost, src=0)
        if lost[0] is not None:
            raise LeaseLost(lost[0])

    # -- pruning

    def _prune(self, newest: str) -> None:
        """Keep the newest `keep` committed checkpoints; drop older ones and every uncommitted
        directory older than `newest` (crashed writes). Only names the run writes are touched,
        the newest committed checkpoint never, and nothing while this launch does not hold the run."""
        if self.fence is not None:
            try:
                self.fence()
            except LeaseLost as err:
                log.error("not pruning: %s", err)
                return
        kept = [name for name, _ in committed(self.storage)]  # newest first
        names = self.storage.checkpoint_names()
        uncommitted = [n for n in names if n < newest and n not in kept]
        for name in kept[max(self.keep, 1):] + uncommitted:
            holders = live_holds(self.storage, name, self._holds)
            if holders:  # pruned at a later commit, once its readers are done
                print(f"shardyard: keeping {self.storage.url(name)} for now: read by "
                      + ", ".join(f"host {h['host']} pid {h['pid']}" for h in holders), flush=True)
                continue
            self.storage.delete(name)

    def _set_aside_bad(self, after: str | None) -> None:
        """Committed checkpoints newer than the one restored failed verification: renamed out of
        the run's names (`<name>.bad`, kept for a look), so this run writes those steps afresh."""
        for name in self.storage.checkpoint_names():
            if after is None or name > after:
                log.warning("setting aside %s, which failed verification, as %s.bad", self.storage.url(name), name)
                self.storage.fs.mv(self.storage.path(name), self.storage.path(f"{name}.bad"), recursive=True)

    def _committed(self, name: str, lineage: Lineage | None = None) -> bool:
        """Whether `name` has a valid commit record (a bad one is named once, by `newest_good`)."""
        try:
            return read_record(self.storage, name, lineage) is not None
        except BadCheckpoint:
            return False

    def _delete_uncommitted(self) -> None:
        lineage = Lineage.of(self.storage)  # the lease read once, not once a checkpoint
        for name in self.storage.checkpoint_names():
            if not self._committed(name, lineage):
                self.storage.delete(name)
