"""Drills where distribution begins: a stale writer, a store that cannot refuse a second create,
containers that share a host name, clocks that disagree. Each failed before its fix (CHANGELOG).
None needs Ray: they act on the lease, the commit records and the event log directly.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from shardyard.checkpoint import reader_holds
from shardyard.storage import events
from shardyard.storage.events import Event, log_event, read_events
from shardyard.checkpoint.generations import LEASE_DIR
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.lease import LeaseFence, LeaseLost, RunLease, StoreCannotFence, identity
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.reader_holds import HOLDS_DIR, CheckpointHold, HoldWatch, live_holds
from shardyard.checkpoint.record import (COMMIT_FILE, BadCheckpoint, CommitRefused, attempt_name, commit, committed, entry,
                                         make_record, newest_good, read_record)
from shardyard.storage.store import RunStorage
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec
from shardyard.train.outcomes import repeated_failure
from helpers.buckets import Bucket
pytestmark = pytest.mark.timeout(120)


def spec_for(storage: str):
    return parse_spec({"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
                       "data": {"name": "synthetic", "num_samples": 64}, "scaling": {"num_workers": 1},
                       "batch": {"global_batch_size": 8, "micro_batch_size": 8},
                       "checkpoint": {"storage_path": storage, "keep": 5}, "run": {"name": "run"}})


class Pause:
    """Where a PausingFence stops: after its `at`-th check, until `resume` is set."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0
        self.paused, self.resume = threading.Event(), threading.Event()


@dataclass(frozen=True)
class PausingFence(LeaseFence):
    """The launch's real fence and, on its `pause.at`-th check, a pause right after the check
    passed (a GC, SIGSTOP, a slow fsync): the moment a stale commit is made in."""

    pause: Pause = field(default_factory=lambda: Pause(0), compare=False)

    def __call__(self) -> None:
        super().__call__()
        self.pause.calls += 1
        if self.pause.calls == self.pause.at:
            self.pause.paused.set()
            self.pause.resume.wait(60)


def params(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_stale_writers_commit_landing_after_a_takeover_is_never_restored_or_kept(tmp_path: Path) -> None:
    """Launch A passes its fence for step 6's commit and pauses; launch B takes the run over from
    step 4; A's step-6 record lands. B restores step 4 (not A's 6), writes its own step 6 (not
    skipping it as committed), and every reader sees B's."""
    spec = spec_for(str(tmp_path))
    a_lease = RunLease(spec.run_uri, "run", ttl_s=30)
    a_lease.acquire()
    # Steps 2 and 4 check the fence twice each (before writing, before committing; pruning checks
    # before each removal, and with keep 5 there is none); step 6's second check (before its
    # commit) passes, then A pauses.
    pause = Pause(at=6)
    fence = PausingFence(spec.run_uri, a_lease.generation, a_lease.id, pause=pause)
    a_engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    a = CheckpointManager(spec.run_uri, keep=5, fence=fence)
    for step in (2, 4):
        a.save(a_engine, TrainState(step, 8 * step, 1), spec)
    with torch.no_grad():
        for p in a_engine.model.parameters():
            p.add_(1.0)  # A's step 6: weights B will never compute
    saving = threading.Thread(target=a.save, args=(a_engine, TrainState(6, 48, 1), spec))
    saving.start()
    assert pause.paused.wait(60), "A never reached its commit"

    b_lease = RunLease(spec.run_uri, "run", ttl_s=30)
    b_lease.acquire(take_over=True)
    pause.resume.set()  # A's stale record lands now (its prune after it is fenced off)
    saving.join(60)
    storage = RunStorage(spec.run_uri)
    stale = json.loads(storage.read_bytes("checkpoint_step_00000006", COMMIT_FILE))
    assert stale["generation"] == a_lease.generation  # it did land
    assert newest_good(storage)[0] == "checkpoint_step_00000004"
    with pytest.raises(BadCheckpoint, match="stale writer"):
        read_record(storage, "checkpoint_step_00000006")

    b_engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    b = CheckpointManager(spec.run_uri, keep=5, fence=b_lease.fence())
    assert b.restore(b_engine).step == 4
    at_four = params(b_engine)
    b.save(b_engine, TrainState(6, 48, 1), spec)  # not skipped as "committed already"
    name, record = newest_good(storage)
    assert name == "checkpoint_step_00000006" and record["generation"] == b_lease.generation
    check = single_process(spec, build_model(spec.model), torch.device("cpu"))
    CheckpointManager(spec.run_uri, keep=5).restore(check)
    for key, value in params(check).items():
        torch.testing.assert_close(value, at_four[key], rtol=0, atol=0, msg=key)
    b_lease.release()
    a_lease.release()


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_worker_group_given_up_on_is_fenced_off_and_its_late_commit_is_stale(tmp_path: Path) -> None:
    """One launch, two worker groups: Ray Train gave up on the first (a node cut off from Ray but
    not from storage) and started a second, under the same lease generation. The first passes its
    fence for step 4's commit and pauses; the second starts from step 2; the first's record lands.
    The second restores step 2 (not 4) and writes its own step 4 (not skipping it as committed),
    and the first is fenced off at its next check."""
    spec = spec_for(str(tmp_path))
    lease = RunLease(spec.run_uri, "run", ttl_s=30)
    lease.acquire()
    first_group = lease.fence().for_new_group()
    pause = Pause(at=4)  # save 2 checks twice (before writing, before committing); save 4's second
    fence = PausingFence(spec.run_uri, lease.generation, lease.id, lease.base_step, first_group.attempt, pause=pause)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    first = CheckpointManager(spec.run_uri, keep=5, fence=fence)
    first.save(engine, TrainState(2, 16, 1), spec)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(1.0)  # the first group's step 4: weights the second never computes
    saving = threading.Thread(target=first.save, args=(engine, TrainState(4, 32, 1), spec))
    saving.start()
    assert pause.paused.wait(60), "the first group never reached its commit"
    second_group = lease.fence().for_new_group()
    assert (first_group.attempt, second_group.attempt) == (1, 2)
    pause.resume.set()
    saving.join(60)
    storage = RunStorage(spec.run_uri)
    assert json.loads(storage.read_bytes("checkpoint_step_00000004", COMMIT_FILE))["attempt"] == 1  # it landed
    with pytest.raises(BadCheckpoint, match="worker group 1 of lease generation 1 after a later group"):
        read_record(storage, "checkpoint_step_00000004")
    with pytest.raises(LeaseLost, match="worker group 2 of this launch has started"):
        fence()

    second = CheckpointManager(spec.run_uri, keep=5, fence=second_group)
    restored_engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    assert second.restore(restored_engine).step == 2
    second.save(restored_engine, TrainState(4, 32, 1), spec)  # not skipped as "committed already"
    name, record = newest_good(storage)
    assert (name, record["attempt"]) == ("checkpoint_step_00000004", 2)
    lease.release()


@pytest.mark.drill(outcome="recovered", lost="the steps since the last commit")
def test_a_save_cut_short_is_cleared_by_the_next_worker_group_and_a_newer_groups_is_left(tmp_path: Path) -> None:
    """A worker killed mid-save leaves that save's directory; the group Ray Train starts next
    clears it as it restores, and leaves alone a save of a group newer than itself."""
    spec = spec_for(str(tmp_path))
    lease = RunLease(spec.run_uri, "run", ttl_s=30)
    lease.acquire()
    first, second = lease.fence().for_new_group(), lease.fence().for_new_group()
    storage = RunStorage(spec.run_uri)
    cut_short = attempt_name("checkpoint_step_00000004", lease.generation, first.attempt)
    newer = attempt_name("checkpoint_step_00000004", lease.generation, second.attempt + 1)
    for save in (cut_short, newer):
        storage.write_bytes(b"{}", save, "spec.json")
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    assert CheckpointManager(spec.run_uri, keep=5, fence=second).restore(engine) is None
    assert not storage.exists(cut_short) and storage.exists(newer)
    lease.release()


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_commit_is_made_only_if_absent_and_a_stale_record_in_its_place_is_set_aside(tmp_path: Path) -> None:
    """A save is renamed into place only while its name is free: a live launch's commit there
    refuses it (and stays whole); a stale writer's commit there is set aside and replaced."""
    spec = spec_for(str(tmp_path))
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    old = RunLease(spec.run_uri, "run", ttl_s=30)
    old.acquire()
    CheckpointManager(spec.run_uri, keep=5, fence=old.fence()).save(engine, TrainState(2, 16, 1), spec)
    storage = RunStorage(spec.run_uri)
    record = read_record(storage, "checkpoint_step_00000002")
    again = attempt_name("checkpoint_step_00000002", old.generation)
    storage.write_bytes(b"{}", again, "spec.json")
    with pytest.raises(CommitRefused, match="generation 1"):
        commit(storage, again, "checkpoint_step_00000002", {**record, "time": 0.0})
    assert read_record(storage, "checkpoint_step_00000002") == record  # untouched
    new = RunLease(spec.run_uri, "run", ttl_s=30)
    new.acquire(take_over=True)  # from step 2
    storage.write_bytes(b"{}", "checkpoint_step_00000004", "spec.json")
    stale = make_record(4, 1, "dcp", {"spec.json": {"size": 2, "crc32c": 0}}, 0.0, generation=old.generation)
    storage.write_bytes(json.dumps(stale).encode(), "checkpoint_step_00000004", COMMIT_FILE)
    mine = {**stale, "generation": new.generation, "time": 1.0}
    written = attempt_name("checkpoint_step_00000004", new.generation)
    storage.write_bytes(b"{}", written, "spec.json")
    commit(storage, written, "checkpoint_step_00000004", mine)
    assert json.loads(storage.read_bytes("checkpoint_step_00000004", COMMIT_FILE)) == mine
    assert not storage.exists(written) and not any(".stale-" in n for n in storage.list())
    new.release()
    old.release()


@pytest.mark.drill(outcome="committed beside, never replaced", lost="nothing")
def test_on_an_object_store_no_commit_deletes_another_writers_record(bucket) -> None:
    """An object store has no rename and no compare-and-delete. A holder (generation 2) finds a
    stale writer's record (generation 1) at step 4's name; a third launch (generation 3) takes the
    run and commits step 4 while the holder is between its judgement and its write. Replacing the
    stale record (delete, then create) deleted the third launch's commit too; each writer's record
    now has a key of its own, nothing is deleted, and the newest writer's record is the one read."""
    storage = RunStorage("s3://bucket/runs/run")
    leases = [RunLease(storage.url(), "run", ttl_s=30) for _ in range(3)]
    leases[0].acquire()
    leases[1].acquire(take_over=True)  # from no checkpoint: generation 1's step 4 will be stale
    name = "checkpoint_step_00000004"

    def save_of(generation: int) -> tuple[str, str, dict]:
        """A save's directory, the checkpoint's name, and the record a commit of it makes."""
        written = attempt_name(name, generation)
        storage.write_bytes(b"{}", written, "spec.json")
        return written, name, make_record(4, 1, "dcp", {"spec.json": entry(b"{}")}, float(generation),
                                    generation=generation, base_step=-1)

    commit(storage, *save_of(1))  # the stale writer's late commit
    third = []

    def third_launch_commits_meanwhile() -> None:  # the holder's fence check, just before its write
        leases[2].acquire(take_over=True)
        commit(storage, *save_of(3))
        third.append(read_record(storage, name))

    commit(storage, *save_of(2), fence=third_launch_commits_meanwhile)
    assert third and third[0]["generation"] == 3
    assert read_record(storage, name)["generation"] == 3  # the third's commit stands
    assert sorted(key for key in storage.list(name) if key.startswith(COMMIT_FILE)) == [
        f"{COMMIT_FILE}.{g:08d}-000000" for g in (1, 2, 3)]
    for lease in leases:
        lease.release()


@pytest.mark.drill(outcome="refused with a message", lost="nothing")
def test_a_run_whose_lease_files_are_lost_keeps_its_checkpoints_and_is_taken_only_when_told(tmp_path: Path) -> None:
    """lease/ cleared (to unstick a lease, left out of a copy, an object-store lifecycle rule):
    the next launch once took generation 1 and deleted every checkpoint of a later generation.
    Now its records are a lineage the lease does not know: kept, the launch refused until it is
    told to take the run over, and then a generation above all of them. A stale writer's commit
    is still judged stale from the records alone, and one checkpoint copied out of its run loads."""
    import shutil

    from shardyard.checkpoint.lease import LineageUnknown
    from shardyard.checkpoint.loaders import find_latest, load_model

    spec = spec_for(str(tmp_path))
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    first = RunLease(spec.run_uri, "run", ttl_s=30)
    first.acquire()
    CheckpointManager(spec.run_uri, keep=5, fence=first.fence()).save(engine, TrainState(2, 16, 1), spec)
    first.release()
    second = RunLease(spec.run_uri, "run", ttl_s=30)
    second.acquire()  # from step 2, generation 2
    CheckpointManager(spec.run_uri, keep=5, fence=second.fence()).save(engine, TrainState(4, 32, 1), spec)
    run = Path(spec.run_uri)
    # The first launch's late commit of step 6 (it started from nothing; the second from step 2).
    shutil.copytree(run / "checkpoint_step_00000004", run / "checkpoint_step_00000006")
    late = json.loads((run / "checkpoint_step_00000006" / COMMIT_FILE).read_text())
    (run / "checkpoint_step_00000006" / COMMIT_FILE).write_text(json.dumps({**late, "step": 6, "generation": 1,
                                                                           "base_step": -1}))
    second.release()
    shutil.rmtree(run / LEASE_DIR)
    storage = RunStorage(spec.run_uri)
    assert newest_good(storage)[0] == "checkpoint_step_00000004"  # step 6 stale, by step 4's record alone

    with pytest.raises(LineageUnknown, match="name lease generation 2, but its lease files .* go up to 0 only"):
        RunLease(spec.run_uri, "run", ttl_s=30).acquire()
    assert sorted(p.name for p in run.glob("checkpoint_step_*")) == [
        "checkpoint_step_00000002", "checkpoint_step_00000004", "checkpoint_step_00000006"]  # nothing deleted
    third = RunLease(spec.run_uri, "run", ttl_s=30)
    third.acquire(take_over=True)
    assert (third.generation, third.base_step) == (3, 4)
    manager = CheckpointManager(spec.run_uri, keep=2, fence=third.fence())
    assert manager.restore(single_process(spec, build_model(spec.model), torch.device("cpu"))).step == 4
    manager.save(engine, TrainState(8, 64, 1), spec)
    assert [name for name, _ in committed(storage)] == ["checkpoint_step_00000008", "checkpoint_step_00000004"]
    third.release()

    copied = tmp_path / "elsewhere" / "run"
    copied.mkdir(parents=True)
    shutil.copytree(run / "checkpoint_step_00000008", copied / "checkpoint_step_00000008")  # as serving advises
    assert find_latest(copied).name == "checkpoint_step_00000008"
    load_model(copied / "checkpoint_step_00000008")


# ----------------------------------------------------------------------------- two holders


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_store_that_lets_a_second_create_through_is_refused_by_name(conditionless_bucket: Bucket) -> None:
    """An S3-compatible store that ignores If-None-Match: the lease's probe finds a second create
    of one name succeeding, and the launch is refused before anything is written."""
    with pytest.raises(StoreCannotFence, match="does not refuse a second create"):
        RunLease("s3://bucket/runs/run", "run", ttl_s=3).acquire()
    assert not conditionless_bucket.fs.exists("bucket/runs/run/lease/00000001.json")


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_store_whose_create_is_check_then_write_is_refused() -> None:
    """fsspec's default exclusive create checks that the name is absent, then writes: one create
    after the other (the probe) is refused, but two launches racing through it both take
    generation 1. Only stores with one atomic create are accepted."""
    import fsspec

    memory = fsspec.filesystem("memory")
    memory.pipe_file("/runs/probe", b"{}", mode="create")
    with pytest.raises(FileExistsError):  # a sequential probe would pass it
        memory.pipe_file("/runs/probe", b"{}", mode="create")
    with pytest.raises(StoreCannotFence, match="no atomic create-if-absent"):
        RunLease("memory://runs/run", "run", ttl_s=3).acquire()
    assert not memory.exists("/runs/run/lease")


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_the_fence_compares_the_holders_id_not_only_its_generation(tmp_path: Path) -> None:
    """Two launches at one generation (what a store without exclusive create allows): the one whose
    id the record does not hold is fenced off."""
    lease = RunLease(str(tmp_path / "run"), "run", ttl_s=30)
    lease.acquire()
    other = json.loads(lease.storage.read_bytes(LEASE_DIR, "00000001.json")) | {"id": "another-launch"}
    lease.storage.write_bytes(json.dumps(other).encode(), LEASE_DIR, "00000001.json")
    with pytest.raises(LeaseLost, match="no longer held"):
        lease.fence()()
    lease.release()


def test_file_uris_are_the_local_path_with_its_fsyncs_and_exclusive_create(tmp_path: Path) -> None:
    storage = RunStorage(f"file://{tmp_path}/run")
    assert not storage.remote and storage.uri == f"{tmp_path}/run"
    assert storage.create_exclusive(b"1", "x") and not storage.create_exclusive(b"2", "x")
    assert spec_for(f"file://{tmp_path}").run_uri == f"{tmp_path}/run"


# ----------------------------------------------------------------------------- containers


def dead_pid() -> int:
    return 4_194_305  # above PID_MAX_LIMIT (2**22): no process can have it


@pytest.mark.parametrize("differs", ["pid_ns", "boot_id"])
@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_holder_in_another_container_on_this_host_is_watched_not_taken_over(tmp_path: Path, differs: str) -> None:
    """A lease record naming this host name but another PID namespace (a container with host
    networking) or another boot: its PID means nothing here, so only the TTL can end it. The same
    record from this very namespace, its process gone, is taken over at once."""
    storage = RunStorage(str(tmp_path / "run"))
    holder = {**identity(), "pid": dead_pid(), "started": 1.0, "generation": 1, "id": "x", "beat": 0,
              "ttl_s": 1.5, "released": False}
    assert holder["host"] == socket.gethostname()
    storage.write_bytes(json.dumps(holder).encode(), LEASE_DIR, "00000001.json")
    start = time.monotonic()
    with RunLease(storage.uri, "run").held():
        pass
    assert time.monotonic() - start < 1.0  # ours and gone: at once
    storage.delete()

    storage.write_bytes(json.dumps({**holder, differs: "elsewhere"}).encode(), LEASE_DIR, "00000001.json")
    start = time.monotonic()
    lease = RunLease(storage.uri, "run")
    lease.acquire()
    assert time.monotonic() - start >= 1.5  # watched for its ttl first
    lease.release()


# ----------------------------------------------------------------------------- clocks


@pytest.mark.drill(outcome="recovered", lost="nothing")
def test_a_hold_from_a_reader_whose_clock_is_behind_keeps_its_checkpoint(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A hold is judged by the pruner's clock: a reader's record with a deadline minutes in the
    pruner's past (its clock is behind; the old rule pruned under it) is live until it stops
    changing for HOLD_TTL_S as the pruner watches."""
    monkeypatch.setattr(reader_holds, "HOLD_TTL_S", 0.5)
    storage = RunStorage(str(tmp_path / "run"))
    behind = {"host": "other-host", "pid": 7, "started": 1.0, "expires": time.time() - 120, "beat": 3}
    storage.write_bytes(json.dumps(behind).encode(), "checkpoint_step_00000002", HOLDS_DIR, "r.json")
    watch = HoldWatch()
    assert live_holds(storage, "checkpoint_step_00000002", watch)
    time.sleep(0.3)
    assert live_holds(storage, "checkpoint_step_00000002", watch)
    storage.write_bytes(json.dumps({**behind, "beat": 4}).encode(), "checkpoint_step_00000002", HOLDS_DIR, "r.json")
    assert live_holds(storage, "checkpoint_step_00000002", watch)  # renewed: watched afresh from now
    time.sleep(0.3)
    assert live_holds(storage, "checkpoint_step_00000002", watch)  # 0.6 s since first seen, 0.3 since renewed
    time.sleep(0.3)
    assert not live_holds(storage, "checkpoint_step_00000002", watch)  # unchanged for 0.6 s: gone


@pytest.mark.drill(outcome="recovered", lost="nothing")
def test_a_hold_survives_an_io_error_in_its_renewal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One failed renewal (the holds directory unwritable for a moment) used to end the renewer
    thread, and the hold with it; now the next renewal writes it again."""
    monkeypatch.setattr(reader_holds, "HOLD_TTL_S", 0.3)
    run = tmp_path / "run"
    (run / "checkpoint_step_00000002").mkdir(parents=True)
    hold = CheckpointHold(str(run), "checkpoint_step_00000002")
    hold.start()
    try:
        holds = run / "checkpoint_step_00000002" / HOLDS_DIR
        for file in holds.iterdir():
            file.unlink()
        holds.rmdir()
        holds.write_text("not a directory")  # the next renewal fails with an OSError
        time.sleep(0.35)
        holds.unlink()
        deadline = time.monotonic() + 10
        while not holds.is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert holds.is_dir() and list(holds.iterdir()), "the renewer stopped after one error"
    finally:
        hold.stop()


@pytest.mark.drill(outcome="recovered", lost="nothing")
def test_a_worker_whose_clock_is_behind_does_not_make_progress_look_like_a_repeated_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller logs a failure; the restarted group's rank 0, on a host 5 s behind, logs its
    start after it, having progressed to step 4. Ordered by clocks the start came first, and two
    failures seemed to follow one start: "failed twice without progress". Ordered by cause, not."""
    run = str(tmp_path / "run")
    error = {"0": "ValueError: bad batch"}
    log_event(run, Event.LAUNCH, id="L")
    log_event(run, Event.START, restored_step=0)
    log_event(run, Event.FAILURE, ranks=[0], errors=error, from_code=True)

    class Behind:
        @staticmethod
        def time() -> float:
            return time.time() - 5.0
    monkeypatch.setattr(events, "time", Behind)
    log_event(run, Event.START, restored_step=4)
    monkeypatch.undo()
    log_event(run, Event.FAILURE, ranks=[0], errors=error, from_code=True)
    assert [e["event"] for e in read_events(run)] == ["launch", "start", "failure", "start", "failure"]
    assert repeated_failure(read_events(run), "L") is None


# ----------------------------------------------------------------------------- SIGTERM, exit codes


@pytest.mark.drill(outcome="stopped, exit 143", lost="nothing")
def test_sigterm_before_training_stops_the_launch_and_releases_the_lease(tmp_path: Path) -> None:
    """SIGTERM while a launch holds the lease but has not begun training (its checks, before Ray's
    start): recorded, not acted on mid-call; the launch stops at its next safe point, releasing
    the lease (the CLI exits 143). Before, Python's default action killed it there, leaving the
    lease to expire and the next launch to wait."""
    import os
    import signal

    from shardyard.checkpoint.generations import current_lease
    from shardyard.train.early_sigterm import StoppedBeforeTraining, sigterm_before_training
    from shardyard.train.launcher import launch

    spec = spec_for(str(tmp_path))
    storage = RunStorage(spec.run_uri)
    storage.write_bytes(b"kept", "notes.txt")  # the run directory stays: only the lease is released
    with sigterm_before_training():
        os.kill(os.getpid(), signal.SIGTERM)  # arrives now: only recorded
        with pytest.raises(StoppedBeforeTraining):
            launch(spec)
    held = current_lease(storage)
    assert held is not None and held["released"]


@pytest.mark.drill(outcome="recovered", lost="nothing")
def test_a_sigterm_just_before_training_begins_is_acted_on_and_its_notice_outlasts_a_storage_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM after the launch's last safe point but before the preemption handler was
    installed was recorded by the early handler and dropped: the run trained until SIGKILL. And
    one failed write of the notice ended the thread that writes it. Now the handler, once
    installed, acts on a SIGTERM already recorded, and the notice is written once storage answers."""
    import os
    import signal

    from shardyard.train.early_sigterm import sigterm_before_training
    from shardyard.train.preemption import preemption_notice
    from shardyard.train.step_guard import PREEMPT_FILE

    spec = spec_for(str(tmp_path))
    storage = RunStorage(spec.run_uri)
    writes = RunStorage.write_bytes
    failures = iter([OSError("the store is down for a moment")] * 2)

    def flaky(self, data, *parts):
        if parts == (PREEMPT_FILE,) and (failure := next(failures, None)) is not None:
            raise failure
        return writes(self, data, *parts)
    monkeypatch.setattr(RunStorage, "write_bytes", flaky)
    with sigterm_before_training():
        os.kill(os.getpid(), signal.SIGTERM)  # after the last safe point: only recorded
        with preemption_notice(spec) as heard:
            deadline = time.monotonic() + 10
            while heard.by != "SIGTERM":
                assert time.monotonic() < deadline, "the SIGTERM recorded before the handler was dropped"
                time.sleep(0.05)
            deadline = time.monotonic() + 10
            while not storage.exists(PREEMPT_FILE):
                assert time.monotonic() < deadline, "the notice was never written after a storage error"
                time.sleep(0.05)


def test_each_outcome_has_its_own_exit_code() -> None:
    from shardyard import exit_codes

    codes = [exit_codes.DONE, exit_codes.GAVE_UP, exit_codes.REFUSED, exit_codes.PREEMPT_TIMED_OUT,
             exit_codes.INTERRUPTED, exit_codes.PREEMPTED]
    assert len(set(codes)) == len(codes)
