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
from typing import Any

import torch
import torch.distributed as dist

from shardyard.checkpoint.collective import Written, barrier, rank, single_process_io, world_size, storage_errors
from shardyard.checkpoint.formats import FORMATS
from shardyard.checkpoint.formats.dcp import DCPFormat
from shardyard.checkpoint.generations import Lineage
from shardyard.checkpoint.layout import SPEC_FILE, STATE_FILE, TrainState, stored_spec
from shardyard.checkpoint.lease import LeaseFence, LeaseLost
from shardyard.checkpoint.reader_holds import HoldWatch, holding, live_holds
from shardyard.checkpoint.record import (ATTEMPT_MARK, BadCheckpoint, CommitRefused, FileEntry, attempt_generation,
                                         attempt_name, checkpoint_name, commit, committed, entry, files_at,
                                         has_record, make_record, newest_good, read_record, record_keys, saves_named,
                                         step_of, valid_record, writer_of)
from shardyard.storage.store import RunStorage
from shardyard.checkpoint.verified_reads import check_entry
from shardyard.parallel import Engine
from shardyard.spec import JobSpec

log = logging.getLogger("shardyard")


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
        # Into each record, where the fence names them (a bare callable fence names neither).
        self.base_step = getattr(fence, "base_step", None)
        self.attempt = getattr(fence, "attempt", None)
        self.spec = spec
        self._holds = HoldWatch()  # what this pruner has seen of readers' holds, by its own clock
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[str, str, Written, dict[str, Any], dict[str, FileEntry]] | None = None
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
            self._delete_older_saves()
            self._clear_unrecorded()
        failed: list[str] = []  # found bad: while choosing (rank 0) or while loading (every rank)
        self.restore_timings = {"verify_s": 0.0, "load_s": 0.0}
        while True:
            choosing = time.perf_counter()
            chosen: list[str | None] = [None]
            if rank() == 0:
                found = newest_good(self.storage, passing_over=failed, found_bad=failed,
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
            self._set_aside_bad(failed, after=chosen[0])
        return state

    def load(self, engine: Engine, name: str) -> TrainState:
        with holding(self.storage.uri, name):  # not pruned under this rank while it reads
            return self._load(engine, name)

    def _load(self, engine: Engine, name: str) -> TrainState:
        record = read_record(self.storage, name)
        if record is None:
            raise BadCheckpoint(f"checkpoint {self.storage.url(name)} is not committed")
        where = files_at(name, record)
        meta = torch.load(io.BytesIO(self._read_checked(where, record, STATE_FILE)), weights_only=True)
        stored = stored_spec(self._read_checked(where, record, SPEC_FILE))
        if self.spec is not None:  # the launched model: never a factory named by the stored file
            stored = stored.model_copy(update={"model": self.spec.model})
        with single_process_io():
            FORMATS[engine.checkpoint_format].load(engine, self.storage, where, record, stored, self.load_optimizer)
        for key, part in engine.checkpointed().items():
            part.load_state_dict(meta.pop(key))
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
        # First: a launch that lost the run stops here, whatever storage holds for this step (a
        # stale launch finding the new holder's commit of it must not skip it and train on).
        self._fenced_everywhere()
        already: list[bool] = [False]
        if rank() == 0:
            already[0] = self._committed_by_us(name)
        if dist.is_initialized():
            dist.broadcast_object_list(already, src=0)
        if already[0]:
            # This launch committed this step already (an earlier worker group of it did): its
            # state is in storage, and writing it again would gain nothing.
            return
        fmt = FORMATS[engine.checkpoint_format]
        own: dict[str, FileEntry] = {}
        # Written under a name no other save uses and renamed into place at commit: a save never
        # deletes or overwrites a directory another launch (or group) may have committed.
        written_to: list[str] = [attempt_name(name, self._writing_generation(), self.attempt)]
        if dist.is_initialized():
            dist.broadcast_object_list(written_to, src=0)
        at = written_to[0]
        if rank() == 0:
            spec_json = spec.model_dump_json(indent=2).encode()
            self.storage.write_bytes(spec_json, at, SPEC_FILE)
            own[SPEC_FILE] = entry(spec_json)
        barrier()  # the directory exists before any rank writes into it
        group = None
        if self.asynchronous and fmt.name == DCPFormat.name and dist.is_initialized():
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            group = self._group
        with single_process_io():
            written = fmt.save(engine, self.storage, at, group)
        if rank() == 0:
            buffer = io.BytesIO()
            torch.save({**asdict(state), **{key: part.state_dict() for key, part in engine.checkpointed().items()}},
                       buffer)
            self.storage.write_bytes(buffer.getvalue(), at, STATE_FILE)
            own[STATE_FILE] = entry(buffer.getvalue())
        record = {"step": state.step, "world_size": world_size(), "format": fmt.name}
        self._pending = (name, at, written, record, own)
        if written.future is None:
            self.wait()

    def wait(self) -> None:
        """Collective: finish the pending write, if any: wait for it (its error is raised here),
        gather every rank's file list, commit it, prune."""
        if self._pending is None:
            return
        name, at, written, record, own = self._pending
        self._pending = None
        if written.future is None:
            barrier()  # every rank's state is written
        else:
            with storage_errors(self.storage.url(at)):  # a background write's error surfaces here
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
                commit(self.storage, at, name, make_record(record["step"], record["world_size"], record["format"],
                                                           listed, time.time(), self._writing_generation(),
                                                           self.base_step, self.attempt),
                       fence=self._fence_here)
            except (CommitRefused, LeaseLost) as err:  # another launch committed this step: it holds the run
                refused[0] = str(err)
            else:
                self._prune()
        if dist.is_initialized():
            dist.broadcast_object_list(refused, src=0)
        if refused[0] is not None:
            raise LeaseLost(refused[0])

    def close(self) -> None:
        self.wait()

    def group_ended(self) -> None:
        """The default group ended (an elastic group changed): a write it left is never committed."""
        self._group, self._pending = None, None

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

    def _fence_here(self) -> None:
        """Rank 0's own check, right before each rename or delete (LeaseLost once another launch
        holds the run): a launch paused between two of them acts on nothing after a takeover."""
        if self.fence is not None:
            self.fence()

    def _prune(self) -> None:
        """Keep the newest `keep` committed checkpoints and drop older ones, each renamed out of
        the run's names in one step and then deleted; the newest never, none a reader holds, and
        each only while this launch holds the run (checked right before it). Below the newest,
        damaged records and stale writers' commits go too; everything else is left alone."""
        try:
            self._delete_older_saves()
            lineage = Lineage.of(self.storage)
            kept = [name for name, _ in committed(self.storage, lineage)]  # newest first
            for name in self.storage.checkpoint_names():  # damaged or stale ones below the newest
                if name not in kept and kept and step_of(name) < step_of(kept[0]) and self._bad(name, lineage):
                    self._clear(name, "damaged")
            for name in kept[max(self.keep, 1):]:
                holders = live_holds(self.storage, name, self._holds)
                if holders:  # pruned at a later commit, once its readers are done
                    print(f"shardyard: keeping {self.storage.url(name)} for now: read by "
                          + ", ".join(f"host {h['host']} pid {h['pid']}" for h in holders), flush=True)
                    continue
                self._fence_here()
                self._remove(name)
        except LeaseLost as err:
            log.error("not pruning: %s", err)

    def _remove(self, name: str) -> None:
        """A committed checkpoint gone: out of the run's names at once (locally a rename; on an
        object store its records first), then its files."""
        if not self.storage.remote:
            self.storage.delete(self.storage.set_aside(name, "pruned"))
            return
        saves = saves_named(self.storage, name)
        for key in record_keys(self.storage, name):  # out of the run's names first
            self.storage.delete(name, key)
        for save in saves:
            self.storage.delete(save)
        self.storage.delete(name)

    def _set_aside_bad(self, bad: list[str], after: str | None) -> None:
        """Checkpoints newer than the one restored that this restore found bad (a file missing or
        corrupted): renamed out of the run's names (`<name>.bad-<random>`, kept for a look), so
        this run writes those steps afresh. Only those: a checkpoint committed since this launch
        chose (by a launch that took the run over meanwhile) is never touched, and each rename is
        fence-checked right before it."""
        newer = [n for n in bad if after is None or step_of(n) > step_of(after)]
        try:
            for name in newer:
                self._fence_here()
                aside = self.storage.set_aside(name, "bad")
                log.warning("set aside %s, which failed verification, as %s", self.storage.url(name), aside)
        except LeaseLost as err:
            log.error("not setting aside bad checkpoints: %s", err)

    def _bad(self, name: str, lineage: Lineage) -> bool:
        """Whether `name`'s record is there and can never count: damaged, or made stale by a
        later generation this launch's lease knows of."""
        try:
            read_record(self.storage, name, lineage)
        except BadCheckpoint:
            return has_record(self.storage, name)
        return False

    def _committed_by_us(self, name: str) -> bool:
        """Whether `name` has a valid commit record of this launch by this worker group or an
        earlier one (a bad one is named once, by `newest_good`). A later group's is not: a group
        that finds one is a zombie, paused after its fence check, and its own commit is refused."""
        record = valid_record(self.storage, name)
        if record is None:
            return False
        generation, attempt = writer_of(record)
        return generation == self._writing_generation() and attempt <= (self.attempt or 0)

    def _clear_unrecorded(self) -> None:
        """Checkpoint names holding no record file at all (a write an older version made in place
        and a crash cut short): cleared, so this run writes those steps afresh. A commit arrives
        by a rename that brings its record along, so such a directory is never one being
        committed. Local storage only: an object store's names hold records alone."""
        if self.storage.remote:
            return
        try:
            for name in self.storage.checkpoint_names():
                if not has_record(self.storage, name):
                    self._clear(name, "partial")
        except LeaseLost as err:
            log.error("not clearing partial checkpoints: %s", err)

    def _clear(self, name: str, why: str) -> None:
        """Remove checkpoint `name`, judged no commit: renamed aside in one step (fence-checked
        right before), then deleted; put back instead if what was moved holds a valid record (a
        commit landed on the name between the judging and the move)."""
        self._fence_here()
        if self.storage.remote:
            self.storage.delete(name)
            return
        aside = self.storage.set_aside(name, why)
        if valid_record(self.storage, aside, step_of(name)) is not None:
            self.storage.place(aside, name)
        else:
            self.storage.delete(aside)

    def _delete_older_saves(self) -> None:
        """Saves of earlier lease generations, or earlier worker groups of this launch, that never
        committed (a crash, a launch taken over): their directories are no checkpoint. A save of
        this group or a later one is left alone, since it may still commit."""
        ours = (self._writing_generation(), self.attempt or 0)
        for name in self.storage.list():
            writer = attempt_generation(name)
            if writer is not None and writer < ours and not self._named_by_record(name):
                self.storage.delete(name)

    def _named_by_record(self, save: str) -> bool:
        """Whether a commit record says its files are in `save` (on an object store a committed
        checkpoint's files stay in the save's directory)."""
        if not self.storage.remote:
            return False
        name = save.partition(ATTEMPT_MARK)[0]
        record = valid_record(self.storage, name)  # a stale or damaged record's files are no checkpoint's
        return record is not None and files_at(name, record) == save
