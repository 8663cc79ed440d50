"""A history test in Jepsen's manner: several launches of one run on one store, a nemesis that
pauses (SIGSTOP/SIGCONT), kills, takes over and shifts clocks, and a checker over the history
they recorded.

Each launch (`LAUNCH`, a process of its own) takes the run's lease, restores the newest
checkpoint and then, step after step, changes its weights by a rule that depends on its lease
generation (so a state tells which launches computed it), records the state's digest, commits a
checkpoint and reads back what landed. Every fence check is recorded with where it was made
(save, restore), so the nemesis can stop a launch right after one passed. Every line of the
history goes to one file, appended whole, so the lines are in the order they happened. The
checker judges by that order alone:

1. a commit of generation g is the run's history if it was logged before any later generation
   began taking the run, or if every later generation started at or above its step: no later
   judgement (a deletion, a restore that skipped it) can make it stale after the fact;
2. a launch starts from at least the newest such commit logged before it began (no committed
   progress is lost), and restores exactly a state some launch computed for that step, whose
   commit is the run's history (not a stale writer's, not a state nobody computed);
3. each commit holds, as it lands, the state its writer computed, and every checkpoint the run
   counts at the end does too.

It runs on local storage and on an S3 server (moto) with conditional writes; on an S3 server that
ignores them, every launch must be refused before it writes anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.record import committed, step_of
from shardyard.checkpoint.store import RunStorage
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec
from conftest import Bucket

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

LAUNCH = r"""
import hashlib, json, os, sys, time
import torch

shift = float(os.environ.get("CLOCK_SHIFT_S", "0"))
if shift:  # this launch's wall clock runs `shift` seconds off the others'
    real_time = time.time
    time.time = lambda: real_time() + shift

from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.lease import LeaseFence, LeaseLost, RunLease
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.record import checkpoint_name
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import SpecError, parse_spec

storage_path, history, take_over = sys.argv[1], sys.argv[2], sys.argv[3] == "take-over"
spec = parse_spec(json.loads(sys.argv[4]) | {"checkpoint": {"storage_path": storage_path, "keep": 3}})


class SlowFence(LeaseFence):
    # The real fence, then a stall (a slow disk, a GC pause) before the write it let through:
    # the window in which a takeover makes that write stale. Most of a launch's time is spent
    # here, so the nemesis's faults mostly land in it; each check is noted with where it was
    # made, so the nemesis can stop the launch inside that window on purpose.
    def __call__(self):
        super().__call__()
        frame, where = sys._getframe(1), "other"
        while frame is not None and where == "other":
            where = {"save": "save", "wait": "commit", "restore": "restore"}.get(frame.f_code.co_name, where)
            frame = frame.f_back
        note(event="fenced", gen=gen, where=where)
        time.sleep(0.1)


loading = CheckpointManager.load


def slow_load(self, engine, name):
    # A restore's load takes minutes on a large model: the window between choosing a checkpoint
    # and acting on what was chosen (noted, so the nemesis can stop the launch inside it).
    if sys._getframe(1).f_code.co_name == "restore":
        note(event="fenced", gen=gen, where="loading")
        time.sleep(0.1)
    return loading(self, engine, name)


CheckpointManager.load = slow_load


def note(**row):
    with open(history, "a") as f:  # one write of a whole line: the lines keep their order
        f.write(json.dumps({"pid": os.getpid(), **row}) + "\n")


def digest(engine):
    h = hashlib.sha256()
    for _, value in sorted(engine.model.state_dict().items()):
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


lease = RunLease(spec.run_uri, "run", ttl_s=1.0)
note(event="acquiring")
try:
    lease.acquire(take_over)
except SpecError as err:
    note(event="refused", reason=str(err))
    sys.exit(2)
gen = lease.generation
note(event="acquired", gen=gen, base=lease.base_step)
engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
manager = CheckpointManager(spec.run_uri, keep=3, fence=SlowFence(spec.run_uri, gen, lease.id), spec=spec)
try:
    restored = manager.restore(engine)
    step = restored.step if restored else 0
    note(event="restore", gen=gen, step=step, digest=digest(engine))
    while True:
        step += 1
        with torch.no_grad():
            for p in engine.model.parameters():
                p.mul_(0.999).add_(0.001 * gen)
        note(event="compute", gen=gen, step=step, digest=digest(engine))
        manager.save(engine, TrainState(step, 8 * step, 1), spec)
        landed = single_process(spec, build_model(spec.model), torch.device("cpu"))
        CheckpointManager(spec.run_uri, keep=3, spec=spec).load(landed, checkpoint_name(step))
        note(event="committed", gen=gen, step=step, landed=digest(landed))
except Exception as err:
    # Fenced off (LeaseLost), or a write the new holder's clean-up cut short (it deletes what no
    # record commits): either way this launch no longer holds the run, which its fence confirms.
    try:
        lease.check()
    except LeaseLost:
        note(event="lost", gen=gen, step=step, error=type(err).__name__)
        sys.exit(3)
    raise
"""

MODEL = {"model": {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8},
         "data": {"name": "synthetic", "num_samples": 64}, "scaling": {"num_workers": 1},
         "batch": {"global_batch_size": 8, "micro_batch_size": 8}, "run": {"name": "run"}}


class History:
    """The recorded history, and the launches the nemesis acts on."""

    def __init__(self, tmp_path: Path, storage_path: str) -> None:
        self.file = tmp_path / "history.jsonl"
        self.file.touch()
        self.storage_path = storage_path
        self.launches: list[subprocess.Popen] = []

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.file.read_text().splitlines() if line.strip()]

    def launch(self, take_over: bool = False, clock_shift_s: float = 0.0) -> subprocess.Popen:
        env = {**os.environ, "CLOCK_SHIFT_S": str(clock_shift_s)}
        process = subprocess.Popen([sys.executable, "-c", LAUNCH, self.storage_path, str(self.file),
                                    "take-over" if take_over else "wait", json.dumps(MODEL)], env=env)
        self.launches.append(process)
        return process

    def wait_for(self, what: Callable[[list[dict]], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not what(self.rows()):
            assert time.monotonic() < deadline, f"the history never got there: {self.rows()[-5:]}"
            time.sleep(0.05)

    def stop_at_fence(self, process: subprocess.Popen, where: str) -> None:
        """SIGSTOP `process` right after its next fence check in `where` passed (save: before it
        writes; commit: before it commits; restore: before it chooses; loading: a restore that
        chose, before it acts on its choice), inside the stall that follows it."""
        seen = len(self.rows())
        self.wait_for(lambda rows: any(r["event"] == "fenced" and r["pid"] == process.pid and r["where"] == where
                                       for r in rows[seen:]))
        process.send_signal(signal.SIGSTOP)

    def commits_by(self, process: subprocess.Popen, n: int) -> None:
        """Wait until `process` has committed `n` more steps (from the moment of the call)."""
        before = sum(r["event"] == "committed" and r["pid"] == process.pid for r in self.rows())
        self.wait_for(lambda rows: sum(r["event"] == "committed" and r["pid"] == process.pid
                                       for r in rows) >= before + n)

    def stop_all(self) -> None:
        for process in self.launches:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait(30)


def nemesis(history: History, operations: int, seed: int) -> None:
    """Random faults, each once the run has made progress (history events, not sleeps)."""
    rng = random.Random(seed)
    holder = history.launch()
    history.commits_by(holder, 2)
    for _ in range(operations):
        fault = rng.choice(["pause", "pause", "pause-then-kill-taker", "kill", "take-over", "take-over"])
        shift = rng.choice([0.0, -600.0, 600.0])  # the next launch's clock: behind, right, ahead
        if fault.startswith("pause"):  # frozen past its lease: the next launch waits out the TTL and takes over
            history.stop_at_fence(holder, rng.choice(["save", "commit", "commit"]))
            taker = history.launch(clock_shift_s=shift)
            history.commits_by(taker, 1)
            holder.send_signal(signal.SIGCONT)  # thawed: a write its last fence check let through happens now
            if fault == "pause-then-kill-taker":  # nothing more of the taker's can write over the damage
                taker.kill()
                holder.wait(30)
                taker.wait(30)
                holder = history.launch(clock_shift_s=shift)
                history.commits_by(holder, 2)
                continue
        elif fault == "kill":  # on this host, its process gone: taken over at once
            holder.kill()
            taker = history.launch(clock_shift_s=shift)
        else:  # --take-over while it runs
            taker = history.launch(take_over=True, clock_shift_s=shift)
        history.commits_by(taker, 2)
        if holder.poll() is None and fault != "kill":
            holder.wait(30)  # fenced off: it stops by itself
            assert holder.returncode == 3, f"a launch whose lease was taken ended with {holder.returncode}"
        holder = taker
    history.stop_all()


def a_stale_save_after_the_takers_commit(history: History) -> None:
    """The holder passes its fence for its next save and is stopped; the taker takes the run over
    and commits that very step; the taker is stopped and the holder thawed (the version before
    saves under names of their own deleted the taker's commit here, to write its own); the taker
    is killed, and a third launch takes the run."""
    holder = history.launch()
    history.commits_by(holder, 2)
    history.stop_at_fence(holder, "save")
    taker = history.launch()
    history.commits_by(taker, 1)
    taker.send_signal(signal.SIGSTOP)
    holder.send_signal(signal.SIGCONT)
    assert holder.wait(60) == 3  # fenced off at its commit
    taker.kill()
    history.commits_by(history.launch(), 1)
    history.stop_all()


def a_stale_restore_after_the_takers_commits(history: History) -> None:
    """A launch chooses its checkpoint and is stopped while loading it; another takes the run over
    and commits two newer steps; it is stopped and the first thawed (the version before set aside
    every checkpoint newer than the one it loaded, the taker's commits among them); the taker is
    killed, and a third launch takes the run."""
    first = history.launch()
    history.commits_by(first, 2)
    first.kill()
    restorer = history.launch()
    history.stop_at_fence(restorer, "loading")
    taker = history.launch()
    history.commits_by(taker, 2)
    taker.send_signal(signal.SIGSTOP)
    restorer.send_signal(signal.SIGCONT)
    assert restorer.wait(60) == 3  # fenced off at its first save
    taker.kill()
    history.commits_by(history.launch(), 1)
    history.stop_all()


def check(history: History, storage: RunStorage) -> None:
    """The checker of the module's docstring, over the rows in the order they were logged."""
    rows = history.rows()
    computed = {(r["gen"], r["step"]): r["digest"] for r in rows if r["event"] == "compute"}
    writers = {(r["step"], r["digest"]): r["gen"] for r in rows if r["event"] == "compute"}
    gen_of = {r["pid"]: r["gen"] for r in rows if r["event"] == "acquired"}
    bases: dict[int, int] = {}  # generation -> the step it started from, as they acquired
    history_commits: set[tuple[int, int]] = set()  # (generation, step): the run's history

    def started_above(gen: int, step: int) -> bool:
        """No generation after `gen` (so far) started below `step`."""
        return all(base >= step for later, base in bases.items() if later > gen)

    newest, floors, restores = 0, {}, 0
    for row in rows:
        event = row["event"]
        if event == "acquiring":
            floors[row["pid"]] = newest
        elif event == "acquired":
            bases[row["gen"]] = max(row["base"], 0)
        elif event == "committed":
            key = (row["gen"], row["step"])
            assert row["landed"] == computed[key], \
                f"generation {key[0]}'s commit of step {key[1]} landed holding a state it never computed"
            # Logged before any later generation began: history, whatever happens to it later.
            # Logged after: history only if no later generation started below it.
            if not any(later > key[0] for later in bases) or started_above(*key):
                history_commits.add(key)
                newest = max(newest, key[1])
        elif event == "restore":
            restores += 1
            gen, base = row["gen"], bases[gen_of[row["pid"]]]
            assert row["step"] == base >= floors[row["pid"]], (
                f"generation {gen} started from step {base} and restored {row['step']}; step "
                f"{floors[row['pid']]} was committed before it began")
            if row["step"] == 0:
                continue
            writer = writers.get((row["step"], row["digest"]))
            assert writer is not None, f"generation {gen} restored a state of step {row['step']} no launch computed"
            if (writer, row["step"]) not in history_commits and started_above(writer, row["step"]):
                history_commits.add((writer, row["step"]))  # committed, then killed before it was logged
            assert (writer, row["step"]) in history_commits, \
                f"generation {gen} restored step {row['step']} from generation {writer}'s stale commit"
    assert restores >= 3
    at_end = list(committed(storage))
    assert at_end, "the run ends with no checkpoint"
    spec = parse_spec(MODEL | {"checkpoint": {"storage_path": "unused", "keep": 3}})
    for name, record in at_end:
        key = (record.get("generation", 0), step_of(name))
        assert key in history_commits or started_above(*key), f"{name} is a stale writer's commit and still counts"
        engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
        CheckpointManager(storage.uri, keep=3, spec=spec).load(engine, name)
        assert digest(engine) == computed.get(key), f"{name} (generation {key[0]}) holds a state its writer never computed"


def digest(engine) -> str:
    h = hashlib.sha256()
    for _, value in sorted(engine.model.state_dict().items()):
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.drill(outcome="recovered", lost="nothing")
def test_a_history_of_pauses_kills_takeovers_and_clock_shifts_on_local_storage(tmp_path: Path) -> None:
    history = History(tmp_path, str(tmp_path / "runs"))
    try:
        nemesis(history, operations=7, seed=1)
    finally:
        history.stop_all()
    check(history, RunStorage(str(tmp_path / "runs" / "run")))


@pytest.mark.drill(outcome="recovered", lost="nothing")
def test_a_history_on_an_s3_server_with_conditional_writes(tmp_path: Path, bucket: Bucket) -> None:
    history = History(tmp_path, "s3://bucket/runs")
    try:
        nemesis(history, operations=3, seed=7)
    finally:
        history.stop_all()
    check(history, RunStorage("s3://bucket/runs/run"))


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_history_on_an_s3_server_without_conditional_writes_never_starts(tmp_path: Path,
                                                                           conditionless_bucket: Bucket) -> None:
    """Two launches, one with --take-over: both refused by the store probe; nothing is written."""
    history = History(tmp_path, "s3://bucket/runs")
    for take_over in (False, True):
        assert history.launch(take_over=take_over).wait(120) == 2
    rows = [r for r in history.rows() if r["event"] != "acquiring"]
    assert [r["event"] for r in rows] == ["refused", "refused"]
    assert "does not refuse a second create" in rows[0]["reason"]
    assert not conditionless_bucket.fs.exists("bucket/runs/run/checkpoint_step_00000001")


@pytest.mark.drill(outcome="recovered", lost="nothing")
@pytest.mark.parametrize("schedule", [a_stale_save_after_the_takers_commit, a_stale_restore_after_the_takers_commits])
def test_a_stale_launch_thawed_after_a_takers_commits_loses_none_of_them(tmp_path: Path, schedule) -> None:
    history = History(tmp_path, str(tmp_path / "runs"))
    try:
        schedule(history)
    finally:
        history.stop_all()
    check(history, RunStorage(str(tmp_path / "runs" / "run")))
