"""A history test in Jepsen's manner: several launches of one run on one store, a nemesis that
pauses (SIGSTOP/SIGCONT), kills, takes over, shifts clocks and starts newer worker groups of a
launch beside a paused one (a zombie group), and a checker over the history they recorded.

Each launch (`LAUNCH`, a process of its own) takes the run's lease and its first worker group's
attempt (a newer group of the launch takes the next attempt), restores the newest checkpoint and
then, step after step, changes its weights by a rule that depends on its lease generation and
attempt (so a state tells which group computed it), records the state's digest, commits a
checkpoint and reads back what landed. Every fence check is recorded with where it was made
(save, restore), so the nemesis can stop a launch right after one passed. Every line of the
history goes to one file, appended whole, so the lines are in the order they happened. The
checker judges by that order alone:

1. a commit of writer w (a generation's worker group) is the run's history if it was logged
   before any later writer began, or if every later writer started at or above its step: no later
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
from shardyard.checkpoint.published import Published
from shardyard.checkpoint.record import committed, step_of
from shardyard.storage.store import RunStorage
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.serve.follow.app_weights import AppWeightsState
from shardyard.serve.follow.follower import follows_publish
from shardyard.spec import parse_spec
from helpers.buckets import Bucket
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

LAUNCH = r"""
import hashlib, json, os, sys, time
import torch

shift = float(os.environ.get("CLOCK_SHIFT_S", "0"))
if shift:  # this launch's wall clock runs `shift` seconds off the others'
    real_time = time.time
    time.time = lambda: real_time() + shift

from shardyard.checkpoint.generations import attempts, current_lease
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.lease import LeaseFence, LeaseLost, RunLease
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.record import checkpoint_name
from shardyard.storage.store import RunStorage
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import SpecError, parse_spec

# "wait" or "take-over": a launch (the lease, then its first worker group); "group": a newer worker
# group of the launch holding the run (Ray Train gave up on the group before and started
# another, while the old one still runs: a zombie, cut off from Ray but not from storage).
storage_path, history, mode = sys.argv[1], sys.argv[2], sys.argv[3]
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
            where = {"save": "save", "wait": "commit", "restore": "restore",
                     "publish": "publish"}.get(frame.f_code.co_name, where)
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


def publish(step):
    # As training publishes to a serving app (train/publish.py): fenced right before, and named
    # by its writer; the app's part (AppWeights) is replayed by the checker from these rows.
    fence()
    note(event="published", gen=gen, attempt=attempt, step=step, digest=digest(engine))


def digest(engine):
    h = hashlib.sha256()
    for _, value in sorted(engine.model.state_dict().items()):
        h.update(value.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


note(event="acquiring")
if mode == "group":
    held = current_lease(RunStorage(spec.run_uri))
    gen, holder = held["generation"], held["id"]
else:
    lease = RunLease(spec.run_uri, "run", ttl_s=1.0)
    try:
        lease.acquire(mode == "take-over")
    except SpecError as err:
        note(event="refused", reason=str(err))
        sys.exit(2)
    gen, holder = lease.generation, lease.id
fence = SlowFence(spec.run_uri, gen, holder).for_new_group()
attempt = fence.attempt
note(event="acquired", gen=gen, attempt=attempt, base=attempts(RunStorage(spec.run_uri))[gen][attempt])
engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
manager = CheckpointManager(spec.run_uri, keep=3, fence=fence, spec=spec)
step = 0
try:
    restored = manager.restore(engine)
    step = restored.step if restored else 0
    note(event="restore", gen=gen, attempt=attempt, step=step, digest=digest(engine))
    while True:
        step += 1
        with torch.no_grad():  # the rule names its writer: a state tells who computed it
            for p in engine.model.parameters():
                p.mul_(0.999).add_(0.001 * gen + 0.0001 * attempt)
        note(event="compute", gen=gen, attempt=attempt, step=step, digest=digest(engine))
        publish(step)  # before the commit, as a run publishing between checkpoints does
        manager.save(engine, TrainState(step, 8 * step, 1), spec)
        landed = single_process(spec, build_model(spec.model), torch.device("cpu"))
        CheckpointManager(spec.run_uri, keep=3, spec=spec).load(landed, checkpoint_name(step))
        note(event="committed", gen=gen, attempt=attempt, step=step, landed=digest(landed))
except Exception as err:
    # Fenced off (LeaseLost: another launch holds the run, or a newer group of this one started),
    # or a write the new holder's clean-up cut short (it deletes what no record commits): either
    # way this group no longer writes for the run, which its fence confirms.
    try:
        fence()
    except LeaseLost:
        note(event="lost", gen=gen, attempt=attempt, step=step, error=type(err).__name__)
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

    def launch(self, take_over: bool = False, clock_shift_s: float = 0.0, group: bool = False) -> subprocess.Popen:
        """A launch of the run (`group`: a newer worker group of the launch holding it)."""
        env = {**os.environ, "CLOCK_SHIFT_S": str(clock_shift_s)}
        mode = "group" if group else "take-over" if take_over else "wait"
        process = subprocess.Popen([sys.executable, "-c", LAUNCH, self.storage_path, str(self.file), mode,
                                    json.dumps(MODEL)], env=env)
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
        fault = rng.choice(["pause", "pause", "pause-then-kill-taker", "kill", "take-over", "take-over",
                            "zombie-group"])
        shift = rng.choice([0.0, -600.0, 600.0])  # the next launch's clock: behind, right, ahead
        if fault == "zombie-group":  # a newer group of the holder's launch starts; the old one is thawed after
            history.stop_at_fence(holder, rng.choice(["save", "commit"]))
            group = history.launch(group=True)
            history.commits_by(group, 1)
            holder.send_signal(signal.SIGCONT)
            assert holder.wait(30) == 3, "a worker group a newer group of its launch replaced wrote on"
            holder = group
            history.commits_by(holder, 1)
            continue
        if fault.startswith("pause"):  # frozen past its lease: the next launch waits out the TTL and takes over
            history.stop_at_fence(holder, rng.choice(["save", "commit", "commit", "publish"]))
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


def a_zombie_group_thawed_after_the_newer_groups_commit(history: History) -> None:
    """The holder's worker group passes its fence for its next save and is stopped; a newer group
    of the same launch starts (Ray Train gave up on the first) and commits that very step; the
    old group is thawed (the version before took the newer group's commit for its own, since the
    generation matched, skipped its save and trained on from a state it had not committed)."""
    holder = history.launch()
    history.commits_by(holder, 2)
    history.stop_at_fence(holder, "save")
    group = history.launch(group=True)
    history.commits_by(group, 1)
    holder.send_signal(signal.SIGCONT)
    assert holder.wait(60) == 3  # its commit refused: the newer group's stands
    history.commits_by(group, 1)
    group.kill()
    history.commits_by(history.launch(), 1)
    history.stop_all()


def a_stale_publish_before_the_takers_first(history: History) -> None:
    """The holder passes its fence to publish a step and is stopped; a taker takes the run over
    from the step before (so the holder's step is a discarded trajectory) and is stopped at its
    own first publish; the holder is thawed and publishes: the app takes it (it is newer than the
    holder's earlier publishes), and no follower may serve it."""
    holder = history.launch()
    history.commits_by(holder, 2)
    history.stop_at_fence(holder, "publish")
    taker = history.launch()
    history.stop_at_fence(taker, "publish")
    holder.send_signal(signal.SIGCONT)
    assert holder.wait(60) == 3  # published, then fenced off at its commit
    taker.send_signal(signal.SIGCONT)
    history.commits_by(taker, 1)
    taker.kill()
    history.commits_by(history.launch(), 1)
    history.stop_all()


def check(history: History, storage: RunStorage) -> None:
    """The checker of the module's docstring, over the rows in the order they were logged. A
    writer is a worker group: (lease generation, attempt), later ones ordered after earlier ones."""
    rows = history.rows()
    computed = {(r["gen"], r["attempt"], r["step"]): r["digest"] for r in rows if r["event"] == "compute"}
    writers = {(r["step"], r["digest"]): (r["gen"], r["attempt"]) for r in rows if r["event"] == "compute"}
    writer_of = {r["pid"]: (r["gen"], r["attempt"]) for r in rows if r["event"] == "acquired"}
    bases: dict[tuple[int, int], int] = {}  # writer -> the step it started from, as they began
    history_commits: set[tuple[int, int, int]] = set()  # (generation, attempt, step): the run's history

    def started_above(writer: tuple[int, int], step: int) -> bool:
        """No writer after `writer` (so far) started below `step`."""
        return all(base >= step for later, base in bases.items() if later > writer)

    newest, floors, restores = 0, {}, 0
    app, stale_publishes, publishes = AppWeightsState(), set(), 0  # the serving app, as the publishes reach it
    model = parse_spec(MODEL).model
    for row in rows:
        event = row["event"]
        if event == "acquiring":
            floors[row["pid"]] = newest
        elif event == "acquired":
            bases[(row["gen"], row["attempt"])] = max(row["base"], 0)
        elif event == "published":
            publishes += 1
            writer = (row["gen"], row["attempt"])
            assert row["digest"] == computed[(*writer, row["step"])]
            if any(later > writer for later in bases):  # published after it had lost the run
                stale_publishes.add((*writer, row["step"]))
            app.put(Published("run", row["step"], model, [], generation=writer[0], attempt=writer[1]))
        shown = app.published  # what a follower looking now would serve of it
        if shown is not None and follows_publish(shown, "run", max(bases, default=(0, 0))):
            assert (*shown.writer, shown.step) not in stale_publishes, \
                f"a follower would serve step {shown.step} published by {shown.writer} after it had lost the run"
        elif event == "committed":
            writer, key = (row["gen"], row["attempt"]), (row["gen"], row["attempt"], row["step"])
            assert row["landed"] == computed[key], \
                f"group {writer}'s commit of step {key[2]} landed holding a state it never computed"
            # Logged before any later writer began: history, whatever happens to it later.
            # Logged after: history only if no later writer started below it.
            if not any(later > writer for later in bases) or started_above(writer, row["step"]):
                history_commits.add(key)
                newest = max(newest, row["step"])
        elif event == "restore":
            restores += 1
            writer, base = (row["gen"], row["attempt"]), bases[writer_of[row["pid"]]]
            assert row["step"] == base >= floors[row["pid"]], (
                f"group {writer} started from step {base} and restored {row['step']}; step "
                f"{floors[row['pid']]} was committed before it began")
            if row["step"] == 0:
                continue
            source = writers.get((row["step"], row["digest"]))
            assert source is not None, f"group {writer} restored a state of step {row['step']} no launch computed"
            if (*source, row["step"]) not in history_commits and started_above(source, row["step"]):
                history_commits.add((*source, row["step"]))  # committed, then killed before it was logged
            assert (*source, row["step"]) in history_commits, \
                f"group {writer} restored step {row['step']} from group {source}'s stale commit"
    assert restores >= 3 and publishes >= 3
    at_end = list(committed(storage))
    assert at_end, "the run ends with no checkpoint"
    spec = parse_spec(MODEL | {"checkpoint": {"storage_path": "unused", "keep": 3}})
    for name, record in at_end:
        writer = (record.get("generation", 0), record.get("attempt") or 0)
        key = (*writer, step_of(name))
        assert key in history_commits or started_above(writer, key[2]), \
            f"{name} is a stale writer's commit and still counts"
        engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
        CheckpointManager(storage.uri, keep=3, spec=spec).load(engine, name)
        assert digest(engine) == computed.get(key), f"{name} (group {writer}) holds a state its writer never computed"


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
        nemesis(history, operations=3, seed=52)  # paused at a publish, a zombie group, a pause
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
@pytest.mark.parametrize("schedule", [a_stale_save_after_the_takers_commit, a_stale_restore_after_the_takers_commits,
                                      a_zombie_group_thawed_after_the_newer_groups_commit,
                                      a_stale_publish_before_the_takers_first])
def test_a_stale_launch_thawed_after_a_takers_commits_loses_none_of_them(tmp_path: Path, schedule) -> None:
    history = History(tmp_path, str(tmp_path / "runs"))
    try:
        schedule(history)
    finally:
        history.stop_all()
    check(history, RunStorage(str(tmp_path / "runs" / "run")))
