"""Parameter servers on the session's Ray cluster: one worker with staleness 0 is single-process
SGD exactly; four asynchronous or bounded-staleness workers reach synchronous training's loss and
never exceed the staleness bound; a killed worker is replaced and a killed server rolls the run back
to the last consistent cut, with every sample used exactly once (ledger audit); a push is applied
at most once; checkpoints pass between parameter servers and the other strategies."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec
from shardyard.data.ledger import audit
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.storage.events import read_events
from shardyard.train.metrics import read_metrics
from helpers.oracle import steps

LOSS_TOLERANCE = 0.05  # relative, on the mean loss of the last 10 steps
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "grad_clip": 0.0, "warmup_steps": 1, "schedule": "constant"}


def ps_job(storage: Path, name: str, workers: int, servers: int, staleness: int | None, total: int,
           optim: dict = SGD) -> dict:
    return {
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"name": "synthetic", "num_samples": 512},
        "optim": optim,
        "batch": {"global_batch_size": 16, "micro_batch_size": 4},
        "parallelism": {"strategy": "parameter_server", "num_servers": servers, "max_staleness": staleness},
        "scaling": {"num_workers": workers, "max_failures": 2},
        "checkpoint": {"storage_path": str(storage), "every_n_steps": 5},
        "run": {"name": name, "steps": total, "log_every": 5},
    }


def synchronous(raw: dict, total: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model, data and global batch in one process: per-step losses, final parameters."""
    raw = {**raw, "parallelism": {"strategy": "ddp"}, "scaling": {"num_workers": 1},
           "batch": {"global_batch_size": 16, "micro_batch_size": 16}}
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    losses = steps(engine, spec, 0, total)
    return losses, engine.model.state_dict()


def logged(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


@pytest.mark.timeout(240)
def test_one_worker_with_staleness_0_is_single_process_sgd(ray_cluster, tmp_path: Path) -> None:
    from shardyard.train.launcher import launch

    raw = ps_job(tmp_path, "one", workers=1, servers=2, staleness=0, total=10)
    result = launch(parse_spec(raw))
    _, expected = synchronous(raw, 10)
    got = load_model(result.checkpoint).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
    assert all(r["staleness_max"] in (0, None) for r in logged(result.run_dir))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("staleness", [None, 1], ids=["async", "bounded"])
def test_four_workers_reach_synchronous_loss_within_the_staleness_bound(
        ray_cluster, tmp_path: Path, staleness: int | None) -> None:
    from shardyard.train.launcher import launch

    total, workers = 40, 4
    # Plain SGD: momentum on stale gradients adds up to an effective momentum that swings with
    # the timing of the pushes, which would make the comparison a matter of luck.
    raw = ps_job(tmp_path, "four", workers=workers, servers=2, staleness=staleness, total=total,
                 optim={**SGD, "momentum": 0.0})
    raw["run"]["log_every"] = 1  # a row per step: several rows come from one progress report
    raw["scaling"]["resources_per_worker"] = {"CPU": 0.5}  # 4 workers on 2 cores
    result = launch(parse_spec(raw))
    rows = logged(result.run_dir)
    sync_losses, _ = synchronous(raw, total)
    # Loss over the last 10 steps (the same samples in both), against synchronous training's.
    ours = sum(r["loss"] for r in rows[-10:]) / 10
    theirs = sum(sync_losses[-10:]) / 10
    print(f"async loss {ours:.4f} sync {theirs:.4f} rows {[round(r['loss'], 3) for r in rows]} "
          f"staleness max {[r['staleness_max'] for r in rows]}")
    assert ours <= theirs * (1 + LOSS_TOLERANCE), (ours, theirs)
    observed = [r["staleness_max"] for r in rows if r["staleness_max"] is not None]
    if staleness is not None:
        assert all(r["largest_clock_gap"] <= staleness for r in rows)
        assert max(observed) <= (workers - 1) * (2 * staleness + 1)
    assert max(observed) > 0  # really asynchronous
    # Steps arrive in bursts; the reported rate must still count each over real time (it once
    # averaged rows that counted their steps over no time at all: 300x the real rate). Real time
    # is the span of the logged rows: the run's wall time also holds its start-up, which a loaded
    # machine can stretch past ten times the training itself.
    span_s = rows[-1]["time"] - rows[0]["time"]
    real_rate = (rows[-1]["step"] - rows[0]["step"]) * raw["batch"]["global_batch_size"] / span_s
    print(f"reported {result.summary['samples_per_s']:.1f} samples/s, real {real_rate:.1f}")
    assert result.summary["samples_per_s"] < 10 * real_rate, (result.summary, real_rate)


@pytest.mark.timeout(300)
def test_a_killed_worker_is_replaced_and_a_killed_server_rolls_back_to_the_last_cut(
        ray_cluster, tmp_path: Path) -> None:
    from ray.util.state import list_actors

    from shardyard.train.launcher import launch

    raw = ps_job(tmp_path, "kill", workers=2, servers=2, staleness=None, total=60)
    raw["run"]["sample_ledger"] = True
    spec = parse_spec(raw)
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=launch(spec)))
    runner.start()
    run_dir = tmp_path / "kill"
    deadline = time.monotonic() + 120
    while find_latest(run_dir) is None:  # a cut to roll back to
        assert runner.is_alive() and time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.2)

    def alive(cls: str) -> list[dict]:
        # The session cluster's, named: without an address Ray's state API joins the newest cluster on
        # the machine, which need not be this one.
        return list_actors(address=ray_cluster.gcs_address, filters=[("class_name", "=", cls), ("state", "=", "ALIVE")])

    os.kill(alive("PSWorker")[0]["pid"], signal.SIGKILL)
    os.kill(alive("ParameterServer")[0]["pid"], signal.SIGKILL)
    runner.join(240)
    assert not runner.is_alive() and outcome["result"].summary["steps"] == 60, outcome
    history = read_events(run_dir)
    kinds = [e["event"] for e in history]
    assert "failure" in kinds and "worker_joined" in kinds, history
    restored = [e for e in history if e["event"] == "server_restored"]
    assert restored and restored[0]["restored_from"].startswith("checkpoint_step_"), history
    # Every sample of each epoch applied exactly once on the final trajectory, although a worker
    # died mid-batch and the run went back to its last cut.
    report = audit(run_dir, 512)
    assert report.steps == 60 and report.exact, report


@pytest.mark.timeout(120)
def test_a_push_is_applied_at_most_once_and_an_old_generation_is_refused(ray_cluster, tmp_path: Path) -> None:
    from shardyard.train.parameter_server.actors import ParameterServer, initial_model

    spec = parse_spec(ps_job(tmp_path, "ids", workers=1, servers=1, staleness=None, total=4))
    model = initial_model(spec)
    names = [n for n, _ in model.named_parameters()][:2]
    server = ParameterServer.remote(spec, names, {n: True for n in names})
    values = [dict(model.named_parameters())[n].detach() for n in names]
    ray.get(server.load.remote(values, [{}, {}], 0, 3))
    grads = [torch.ones_like(v) for v in values]
    assert ray.get(server.push.remote(grads, (3, 0), 0)) == "applied"
    once = ray.get(server.pull.remote())[2]
    assert ray.get(server.push.remote(grads, (3, 0), 0)) == "duplicate"  # a retry of batch 0
    assert ray.get(server.push.remote(grads, (2, 16), 0)) == "refused"   # before a rollback
    generation, version, after = ray.get(server.pull.remote())
    assert (generation, version) == (3, 1)
    for a, b, start in zip(once, after, values):
        assert torch.equal(a, b) and not torch.equal(a, start)
    ray.kill(server)


@pytest.mark.timeout(300)
def test_checkpoints_pass_between_parameter_servers_and_the_other_strategies(ray_cluster, tmp_path: Path) -> None:
    """DDP trains steps 1-4, parameter servers (one worker, staleness 0: synchronous) 5-8 from its
    checkpoint, ZeRO-2 9-12 from theirs: with plain SGD the whole chain is one process's 12 steps.
    The parameter servers run on Ray; DDP and ZeRO-2 on local ranks (the same Trainer that Ray
    Train's workers run: a Ray launch would only add half a minute each)."""
    from shardyard.localdist import run_distributed
    from shardyard.train.launcher import launch
    from helpers.oracle import train

    raw = ps_job(tmp_path, "chain", workers=1, servers=2, staleness=0, total=12, optim={**SGD, "momentum": 0.0})
    raw["checkpoint"]["every_n_steps"] = 4
    stages = [({"strategy": "ddp"}, 2, 4), ({"strategy": "parameter_server", "num_servers": 2,
                                                 "max_staleness": 0}, 1, 8), ({"strategy": "zero2"}, 2, 12)]
    for parallelism, workers, until in stages:
        stage = {**raw, "parallelism": parallelism, "scaling": {"num_workers": workers},
                 "run": {**raw["run"], "steps": until}}
        if parallelism["strategy"] == "parameter_server":
            assert launch(parse_spec(stage)).summary["steps"] == until
        else:
            run_distributed(train, workers, stage)
        assert find_latest(tmp_path / "chain").name.endswith(f"{until:08d}")
    _, expected = synchronous(raw, 12)
    got = load_model(find_latest(tmp_path / "chain")).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.timeout(360)
def test_workers_join_when_a_node_brings_room_and_a_killed_job_resumes(ray_cluster, tmp_path: Path) -> None:
    """Elastic: one slot at first, a second when a node joins; then the whole job (its driver,
    and with it every actor) is killed and submitted again with the same storage."""
    import json
    import subprocess
    import sys

    from shardyard.train.launcher import launch
    from helpers.elastic import SLOT, WorkerNode
    from helpers.fake_cluster import wait_for
    total = 800  # one worker alone for ~15 s of it while the second node starts
    raw = ps_job(tmp_path, "grow", workers=1, servers=2, staleness=None, total=total)
    raw["checkpoint"]["every_n_steps"] = 25
    raw["scaling"] = {"min_workers": 1, "max_workers": 2, "max_failures": 2,
                      "resources_per_worker": {"CPU": 1, SLOT: 1}}  # only the extra nodes have slots
    raw["run"]["sample_ledger"] = True
    config = tmp_path / "grow.yaml"
    config.write_text(json.dumps(raw))  # JSON is YAML
    run_dir = tmp_path / "grow"
    nodes = [WorkerNode(ray_cluster.gcs_address, 1, tmp_path / "node_a.log")]
    driver = subprocess.Popen([str(Path(sys.executable).with_name("shardyard")), "train", str(config)],
                              env={**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def joined() -> list[dict]:
            return [e for e in read_events(run_dir) if e["event"] == "worker_joined"]

        wait_for(lambda: joined() or driver.poll() is not None, 120, "no worker joined")
        time.sleep(2)
        assert len(joined()) == 1 and driver.poll() is None  # one slot: the other worker waits for room
        nodes.append(WorkerNode(ray_cluster.gcs_address, 1, tmp_path / "node_b.log"))
        wait_for(lambda: len(joined()) == 2 or driver.poll() is not None, 90, "no worker joined")
        grown_at = joined()[1]["step"]
        wait_for(lambda: (find_latest(run_dir) is not None and int(find_latest(run_dir).name[-8:]) > grown_at)
                 or driver.poll() is not None, 120, "no checkpoint after growing")
        assert driver.poll() is None, driver.communicate()[0][-3000:]
        driver.send_signal(signal.SIGKILL)  # the whole job: Ray ends its actors with it
        driver.wait()
        stopped_at = int(find_latest(run_dir).name[-8:])
        assert 0 < grown_at < stopped_at < total

        result = launch(parse_spec(raw))  # submitted again, same storage and name
        assert result.summary["steps"] == total, result.summary
        starts = [e for e in read_events(run_dir) if e["event"] == "start"]
        assert len(starts) == 2 and starts[1]["restored_step"] >= stopped_at, starts
        rows = logged(run_dir)
        assert {r["world_size"] for r in rows} >= {1, 2}, rows
        assert [r["step"] for r in rows if r["step"] > stopped_at][-1] == total
        report = audit(run_dir, 512)  # the killed job's unfinished stretch is redone, nothing twice
        assert report.steps == total and report.exact, report
    finally:
        if driver.poll() is None:
            driver.kill()
        for node in nodes:
            node.stop()


@pytest.mark.timeout(240)
def test_a_diverging_parameter_server_run_stops_and_commits_nothing_non_finite(ray_cluster, tmp_path: Path) -> None:
    """run.on_nonfinite: stop holds for parameter servers too: a loss that is not finite stops the
    run naming the step (RunGaveUp, the CLI's exit 1), and no committed checkpoint holds NaN or inf
    (before: the run went on and committed them)."""
    from shardyard.train.outcomes import RunGaveUp
    from shardyard.train.launcher import launch

    raw = ps_job(tmp_path, "diverging", workers=2, servers=2, staleness=0, total=40,
                 optim={**SGD, "lr": 1e6, "momentum": 0.0})
    raw["checkpoint"]["every_n_steps"] = 1
    raw["checkpoint"]["keep"] = 100
    with pytest.raises(RunGaveUp, match="not finite at step"):
        launch(parse_spec(raw))
    run = tmp_path / "diverging"
    assert [e for e in read_events(run) if e["event"] == "diverged"]
    for checkpoint in run.glob("checkpoint_step_*"):
        if (checkpoint / "COMMITTED").exists():
            assert all(torch.isfinite(v).all() for v in load_model(checkpoint).state_dict().values()), checkpoint.name


@pytest.mark.timeout(300)
def test_sigterm_checkpoints_a_parameter_server_run_at_the_step_in_flight(ray_cluster, tmp_path: Path) -> None:
    """SIGTERM to the driver (here, this process's main thread runs it) cuts at the step being
    computed, commits it and stops (Preempted, exit 143); the next launch goes on from that step
    (before: the driver died without a checkpoint, losing everything since the last interval)."""
    from shardyard.train.outcomes import Preempted
    from shardyard.train.launcher import launch

    raw = ps_job(tmp_path, "preempted", workers=2, servers=2, staleness=None, total=10_000)
    raw["checkpoint"]["every_n_steps"] = 5_000  # far away: only the notice can make a checkpoint
    run = tmp_path / "preempted"

    def notice_once_training() -> None:
        deadline = time.monotonic() + 120
        while not any(row["step"] >= 5 for row in logged(run)) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=notice_once_training, daemon=True).start()
    with pytest.raises(Preempted, match="after committing step"):
        launch(parse_spec(raw))
    stopped = [e for e in read_events(run) if e["event"] == "preempted"]
    assert len(stopped) == 1 and find_latest(run).name == f"checkpoint_step_{stopped[0]['step']:08d}"
    raw["run"]["steps"] = stopped[0]["step"] + 5
    launch(parse_spec(raw))
    starts = [e for e in read_events(run) if e["event"] == "start"]
    assert starts[-1]["restored_step"] == stopped[0]["step"]
