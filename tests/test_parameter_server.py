"""Parameter servers on the session's Ray cluster: one worker with staleness 0 is single-process
SGD exactly; four asynchronous or bounded-staleness workers reach synchronous training's loss and
never exceed the staleness bound; a killed worker is replaced and a killed server restored."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec
from shardyard.train.checkpoint import load_model
from shardyard.train.metrics import METRICS_FILE, read_events
from test_strategies import steps

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
    import json

    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


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
    result = launch(parse_spec(raw))
    rows = logged(result.run_dir)
    sync_losses, _ = synchronous(raw, total)
    # Loss over the last 10 steps (the same samples in both), against synchronous training's.
    ours = sum(r["loss"] for r in rows[-2:]) / 2
    theirs = sum(sync_losses[-10:]) / 10
    print(f"async loss {ours:.4f} sync {theirs:.4f} rows {[round(r['loss'], 3) for r in rows]} "
          f"staleness max {[r['staleness_max'] for r in rows]}")
    assert ours <= theirs * (1 + LOSS_TOLERANCE), (ours, theirs)
    observed = [r["staleness_max"] for r in rows if r["staleness_max"] is not None]
    if staleness is not None:
        assert all(r["largest_clock_gap"] <= staleness for r in rows)
        assert max(observed) <= (workers - 1) * (2 * staleness + 1)
    assert max(observed) > 0  # really asynchronous


@pytest.mark.timeout(300)
def test_a_killed_worker_is_replaced_and_a_killed_server_restores_from_its_snapshot(
        ray_cluster, tmp_path: Path) -> None:
    from ray.util.state import list_actors

    from shardyard.train.checkpoint import find_latest
    from shardyard.train.launcher import launch

    spec = parse_spec(ps_job(tmp_path, "kill", workers=2, servers=2, staleness=None, total=60))
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=launch(spec)))
    runner.start()
    run_dir = tmp_path / "kill"
    deadline = time.monotonic() + 120
    while find_latest(run_dir) is None:  # a snapshot to restore from
        assert runner.is_alive() and time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.2)

    def alive(cls: str) -> list[dict]:
        return list_actors(filters=[("class_name", "=", cls), ("state", "=", "ALIVE")])

    os.kill(alive("PSWorker")[0]["pid"], signal.SIGKILL)
    os.kill(alive("ParameterServer")[0]["pid"], signal.SIGKILL)
    runner.join(240)
    assert not runner.is_alive() and outcome["result"].summary["steps"] == 60, outcome
    history = read_events(str(tmp_path), "kill")
    kinds = [e["event"] for e in history]
    assert "failure" in kinds and "worker_joined" in kinds, history
    restored = [e for e in history if e["event"] == "server_restored"]
    assert restored and restored[0]["restored_from"].startswith("checkpoint_step_"), history


@pytest.mark.timeout(360)
def test_workers_join_when_a_node_brings_room_and_a_killed_job_resumes(ray_cluster, tmp_path: Path) -> None:
    """Elastic: one slot at first, a second when a node joins; then the whole job (its driver,
    and with it every actor) is killed and submitted again with the same storage."""
    import json
    import subprocess
    import sys

    from shardyard.train.checkpoint import find_latest
    from shardyard.train.launcher import launch
    from test_elastic import SLOT, WorkerNode, wait_for

    total = 800  # one worker alone for ~15 s of it while the second node starts
    raw = ps_job(tmp_path, "grow", workers=1, servers=2, staleness=None, total=total)
    raw["checkpoint"]["every_n_steps"] = 25
    raw["scaling"] = {"min_workers": 1, "max_workers": 2, "max_failures": 2,
                      "resources_per_worker": {"CPU": 1, SLOT: 1}}  # only the extra nodes have slots
    config = tmp_path / "grow.yaml"
    config.write_text(json.dumps(raw))  # JSON is YAML
    run_dir = tmp_path / "grow"
    nodes = [WorkerNode(ray_cluster.gcs_address, 1, tmp_path / "node_a.log")]
    driver = subprocess.Popen([str(Path(sys.executable).with_name("shardyard")), "train", str(config)],
                              env={**os.environ, "RAY_ADDRESS": ray_cluster.gcs_address},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def joined() -> list[dict]:
            return [e for e in read_events(str(tmp_path), "grow") if e["event"] == "worker_joined"]

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
        starts = [e for e in read_events(str(tmp_path), "grow") if e["event"] == "start"]
        assert len(starts) == 2 and starts[1]["restored_step"] >= stopped_at, starts
        rows = logged(run_dir)
        assert {r["world_size"] for r in rows} >= {1, 2}, rows
        assert [r["step"] for r in rows if r["step"] > stopped_at][-1] == total
    finally:
        if driver.poll() is None:
            driver.kill()
        for node in nodes:
            node.stop()
