"""An elastic run on a cluster Ray's autoscaler grows and shrinks (helpers/fake_cluster.py): the
run asks for more workers and grows, a node gets a preemption notice and the run checkpoints, the
node is reclaimed and the run shrinks, the idle nodes go. Each resize is timed; the run waits at
hold points, so the scenario does not depend on the machine's speed. tests/train/ checks it trains
exactly; benchmarks/recovery.py times it."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil

from shardyard.checkpoint.loaders import find_latest
from shardyard.checkpoint.record import checkpoint_name
from shardyard.storage.events import read_events
from shardyard.train.callbacks import HOLD_ENV
from shardyard.train.callbacks import held_at as held
from shardyard.train.callbacks import release

from helpers.fake_cluster import RAY, FakeAutoscalingCluster, wait_for
from helpers.repo import DEFAULT_JOB as CONFIG

AUTOSCALED_SLOT = "autoscaled_slot"  # a worker's share: 2 on the head, 1 per autoscaled node

DRAIN_PROBE_S = 5.5  # StepGuard's drain_every_s (5 s), and a margin

# Ray Train's PreemptionWatcher polls the cluster's draining nodes every 5 s
# (RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S) and then tells the workers; a margin for that call.
DRAIN_NOTICE_S = 7.0


def elastic_job(storage: Path) -> list[str]:
    """The benchmark's elastic run: the default GPT, 2 to 4 workers, 300 steps."""
    return ["scaling.num_workers=null", "scaling.min_workers=2", "scaling.max_workers=4",
            "scaling.max_failures=3", "scaling.resize_check_interval_s=2",
            "scaling.worker_start_timeout_s=30", "batch.global_batch_size=48",  # 2, 3 or 4 workers x 4 x k
            "batch.micro_batch_size=4", "run.steps=300",
            "run.log_every=25", "checkpoint.every_n_steps=25", "run.sample_ledger=true",
            f"checkpoint.storage_path={storage}", "run.name=autoscaled"]


def measure_autoscaled(overrides: list[str], run_dir: Path, hold_at: tuple[int, int] = (25, 50)) -> list[dict]:
    """Runs the autoscaled scenario (see the module's docstring) with the job's `overrides`
    (their scaling bounds 2 to 4) and returns each resize's timings. The run waits at the
    checkpoints of `hold_at` (first: until it has grown; second: until a worker's node is drained),
    so the scenario does not depend on this machine's speed."""
    grown_at, drain_at = hold_at
    with FakeAutoscalingCluster({"CPU": 2, AUTOSCALED_SLOT: 2}, {"CPU": 1, AUTOSCALED_SLOT: 1},
                                max_nodes=2, idle_timeout_s=10) as cluster:
        command = [str(Path(RAY).with_name("shardyard")), "train", str(CONFIG)]
        for item in [*overrides, f"scaling.resources_per_worker={{CPU: 1, {AUTOSCALED_SLOT}: 1}}"]:
            command += ["--set", item]
        env = {**cluster.env, "RAY_ADDRESS": cluster.gcs_address, HOLD_ENV: f"{grown_at},{drain_at}"}
        # Its nodes launch once the run has started on the head's room: else, on a busy machine,
        # they could join before the first group starts and the run would begin at 4, not grow.
        cluster.hold_autoscaler()
        run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            starts = lambda: [e for e in read_events(run_dir) if e["event"] == "start"]  # noqa: E731
            wait_for(lambda: starts() or run.poll() is not None, 300, "the run never started")
            cluster.release_autoscaler()
            wait_for(lambda: held(run_dir, grown_at) or run.poll() is not None, 300, f"no step {grown_at}")
            wait_for(lambda: any(e["world_size"] == 4 for e in starts()) or run.poll() is not None, 180,
                       "the autoscaler's nodes never joined the run")
            launched = sorted(psutil.Process(pid).create_time() for pid in cluster.autoscaled_raylets().values())
            release(run_dir, grown_at)
            wait_for(lambda: held(run_dir, drain_at) or run.poll() is not None, 300, f"no step {drain_at}")
            victim = next(iter(cluster.autoscaled_raylets()))
            subprocess.run([RAY, "drain-node", f"--address={cluster.gcs_address}", f"--node-id={victim}",
                            "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot reclaim",
                            "--deadline-remaining-seconds=120"], env=cluster.env, check=True,
                           capture_output=True, timeout=60)
            drained_at = time.time()  # the drain is accepted once the command returns
            # Held until Ray Train's watcher has surely polled since the drain (and told the workers)
            # and the run's own probe (at most every DRAIN_PROBE_S) is due, the run asks at its first
            # step after the release and hears the notice: else it could end before asking again.
            ready_at = max(held(run_dir, drain_at)["time"] + DRAIN_PROBE_S, drained_at + DRAIN_NOTICE_S)
            time.sleep(max(0.0, ready_at - time.time()))
            release(run_dir, drain_at)
            released_at = time.time()
            wait_for(lambda: drain_checkpoint(run_dir) or run.poll() is not None, 120,
                       "the run did not checkpoint on the drain notice")
            checkpointed = drain_checkpoint(run_dir)
            if checkpointed is None:
                output = run.communicate(timeout=60)[0]
                raise RuntimeError(f"the run ended (exit {run.returncode}) without a drain checkpoint:\n"
                                   f"{output[-4000:]}")
            # The event marks the checkpoint's start: the node goes once it is committed.
            wait_for(lambda: find_latest(run_dir).name == checkpoint_name(checkpointed["step"]), 120,
                       "the drain checkpoint never committed")
            committed_at = time.time()
            reclaimed_at = time.time()
            cluster.reclaim(victim)
            output, _ = run.communicate(timeout=600)
            if run.returncode != 0:
                raise RuntimeError(f"the autoscaled run failed:\n{output[-4000:]}")
            ended_at = time.time()
            wait_for(lambda: not cluster.autoscaled_raylets(), 120, "the idle nodes were never removed")
            idle_removed_at = time.time()
        finally:
            release(run_dir, grown_at, drain_at)
            if run.poll() is None:
                run.kill()
    asked = next(e for e in read_events(run_dir) if e["event"] == "launch")  # the run asks for 4 at once
    first, grown = starts()[0], next(e for e in starts() if e["world_size"] == 4)
    shrunk = next(e for e in starts() if e["time"] > reclaimed_at)
    return [
        {"resize": f"grow {first['world_size']} -> 4", "cause": "the run asks, the autoscaler adds 2 nodes",
         "s": grown["time"] - launched[-1], "nodes launched after s": launched[-1] - asked["time"],
         "restored from": grown["restored_step"]},
        {"resize": "notice heard -> checkpoint committed", "cause": "ray drain-node (preemption)",
         "s": committed_at - released_at,
         "nodes launched after s": None, "restored from": None},
        {"resize": f"shrink 4 -> {shrunk['world_size']}", "cause": "the drained node is reclaimed",
         "s": shrunk["time"] - reclaimed_at, "nodes launched after s": None, "restored from": shrunk["restored_step"]},
        {"resize": "idle nodes removed", "cause": "autoscaler idle timeout (10 s)", "s": idle_removed_at - ended_at,
         "nodes launched after s": None, "restored from": None},
    ]


def drain_checkpoint(run_dir: Path) -> dict | None:
    return next((e for e in read_events(run_dir) if e["event"] == "drain_checkpoint"), None)
