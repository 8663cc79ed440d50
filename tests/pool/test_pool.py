"""The elastic pool (`shardyard pool`): the arbiter's decisions on their own (no Ray), the pool
spec's checks, and two pools on a local Ray instance whose devices are a custom resource. One
episode on 3 devices: serving load rises past the SLO, the run lends a worker (its newest worker
leaves the group at a step boundary), Serve places its second replica on the freed device; load
falls, Serve lets the replica go, the run takes the device back (a worker joins). The episode is
the benchmark's (benchmarks/pool_episode.py), driven by the run's own events. And an app scaled
to zero on 2 devices, woken twice by a request on a device the run lends.

Checked: the decisions and their order in the run's log and the app's metrics; one group start
(nothing restarted, nothing recomputed); no request failed; every sample used exactly once
across every lend and return; the final weights equal single-process training to the same step
(plain SGD, no clipping: a wrong gradient scale at any world size would show).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch

from helpers.fake_cluster import wait_for
from helpers.pool_episode import SHAPES, episode_job, run_episode, run_wakes, served, stop
from shardyard.storage.events import read_events
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.data.ledger import audit
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.pool.arbiter import training_size
from shardyard.pool.command import Pool, at_size, connect
from shardyard.pool.load import LoadBook, ReplicaLoad
from shardyard.pool.policy import Arbitration, Observation
from shardyard.pool.spec import Policy, load_pool
from shardyard.serve.app.deployment import woken_promptly
from shardyard.spec import SpecError
from helpers.oracle import steps
from helpers.repo import REPO, SHARDYARD

POOL = REPO / "jobs" / "configs" / "pool.yaml"

# The mechanics alone: no resize cost, dwell or budget (the flapping test has them).
POLICY = Policy.model_validate({"lend_when": {"signal": "queue_length", "above": 3, "for_s": 5}, "cool_down_s": 20,
                                "resize_cost_s": 0, "min_dwell_s": 0})


def seen(t: float, signal: float | None, running: int = 1, wanted: int = 1, free: float = 0, size: int | None = 2,
         placed: int | None = None):
    """What the arbiter sees; the pool's devices are the run's, the free ones and those of the
    replicas Serve has placed (by default, those running)."""
    return Observation(t, signal, running, wanted, free, size, (size or 0) + free + (running if placed is None else placed))


def test_a_breach_lends_one_device_once_it_has_lasted_and_serve_waits_for_a_device() -> None:
    a = Arbitration(POLICY, min_workers=1, max_workers=3, start_workers=3)
    assert a.observe(seen(0, 9, wanted=2, size=3)) is None          # breach begins
    assert a.observe(seen(4, 9, wanted=2, size=3)) is None          # not for 5 s yet
    lend = a.observe(seen(5, 9, wanted=2, size=3))
    assert (lend.kind, lend.from_workers, lend.to_workers) == ("lend", 3, 2) and a.allotment == 2
    assert a.observe(seen(6, 9, wanted=2, size=3)) is None          # the run is still at 3: resizing
    assert a.observe(seen(8, 9, wanted=2, size=2)) is None          # 5 s from the decision, not the breach
    assert a.observe(seen(10, 9, wanted=2, size=2)) is None         # the hour's second lend waits twice as long
    second = a.observe(seen(15, 9, wanted=2, size=2))
    assert (second.kind, second.to_workers) == ("lend", 1)
    assert a.observe(seen(40, 9, wanted=2, size=1)) is None         # never below min_workers


@pytest.mark.parametrize("why_not", ["serve_has_all_it_wants", "a_device_is_free", "priority_training", "flapping"])
def test_no_lend(why_not: str) -> None:
    policy = POLICY.model_copy(update={"priority": "training"}) if why_not == "priority_training" else POLICY
    a = Arbitration(policy, min_workers=1, max_workers=2, start_workers=2)
    for t in range(30):
        signal = (9 if t % 2 else 1) if why_not == "flapping" else 9  # over the bound every other second
        wanted = 1 if why_not == "serve_has_all_it_wants" else 2
        free = 1 if why_not == "a_device_is_free" else 0
        assert a.observe(seen(t, signal, wanted=wanted, free=free)) is None
    assert a.allotment == 2


def test_a_device_goes_back_after_the_cool_down_once_serve_lets_it_go() -> None:
    a = Arbitration(POLICY, min_workers=1, max_workers=2, start_workers=2)
    a.observe(seen(0, 9, wanted=2))
    assert a.observe(seen(5, 9, wanted=2)).kind == "lend"
    a.observe(seen(10, 9, running=2, wanted=2, size=1))             # the lent replica serves
    a.observe(seen(12, 1, running=2, wanted=2, size=1))             # load falls; last breach at 10
    assert a.observe(seen(29, 1, running=2, wanted=2, size=1)) is None  # Serve keeps the replica: no device free
    assert a.observe(seen(29, 1, running=1, wanted=1, free=1, size=1)) is None  # 19 s of calm, not 20
    back = a.observe(seen(30, 1, running=1, wanted=1, free=1, size=1))
    assert (back.kind, back.from_workers, back.to_workers, a.lent) == ("return", 1, 2, 0)
    assert a.observe(seen(60, 1, running=1, wanted=1, free=1, size=2)) is None  # nothing lent: nothing to take


def test_a_breach_during_the_cool_down_starts_it_again() -> None:
    a = Arbitration(POLICY, min_workers=1, max_workers=2, start_workers=2)
    a.observe(seen(0, 9, wanted=2))
    a.observe(seen(5, 9, wanted=2))
    a.observe(seen(10, 1, running=1, wanted=1, free=1, size=1))
    a.observe(seen(25, 9, running=1, wanted=1, free=1, size=1))     # a spike: the cool-down restarts
    assert a.observe(seen(40, 1, running=1, wanted=1, free=1, size=1)) is None
    assert a.observe(seen(45, 1, running=1, wanted=1, free=1, size=1)).kind == "return"


def test_a_request_at_zero_replicas_wakes_one_at_once_whatever_the_flapping_bounds() -> None:
    """Scaled to zero, no replica reports load, so no SLO can be breached: Serve wanting a replica
    while none serves lends a device at once, past a dwell, back-off and budget that would hold a
    breach's lend (a request waits for as long as no replica serves)."""
    held = POLICY.model_copy(update={"min_dwell_s": 600, "resize_cost_s": 600, "max_lends_per_hour": 1})
    a = Arbitration(held, min_workers=1, max_workers=2, start_workers=2)
    assert a.observe(seen(0, None, running=0, wanted=0)) is None      # at zero, no one asks
    wake = a.observe(seen(1, None, running=0, wanted=1))             # a request: Serve wants a replica
    assert (wake.kind, wake.to_workers, wake.wake) == ("lend", 1, True)
    a.observe(seen(20, None, running=1, wanted=1, size=1))          # it serves, then goes idle
    assert a.observe(seen(630, None, running=0, wanted=0, free=1, size=1)).kind == "return"
    again = a.observe(seen(631, None, running=0, wanted=1, size=2))  # the next request, 1 s later
    assert (again.kind, again.wake) == ("lend", True)


@pytest.mark.parametrize("why_not", ["priority_training", "at_min_workers", "a_device_is_free", "a_replica_serves",
                                     "starting_on_a_free_device"])
def test_no_wake(why_not: str) -> None:
    policy = POLICY.model_copy(update={"priority": "training"}) if why_not == "priority_training" else POLICY
    start = 1 if why_not == "at_min_workers" else 2
    a = Arbitration(policy, min_workers=1, max_workers=2, start_workers=start)
    running, wanted = (1, 2) if why_not == "a_replica_serves" else (0, 1)
    free = 1 if why_not == "a_device_is_free" else 0
    placed = 1 if why_not == "starting_on_a_free_device" else None  # the device it took is no longer free
    assert a.observe(seen(0, None, running=running, wanted=wanted, free=free, size=start, placed=placed)) is None


def test_an_app_scaled_to_zero_hears_of_a_request_within_a_second() -> None:
    """Serve's router reports a request waiting at zero replicas with the queue it sampled
    before it: Serve wanted a replica only at the next report, 10 s later by default."""
    assert woken_promptly({"min_replicas": 0, "max_replicas": 2})["metrics_interval_s"] == 1.0
    assert woken_promptly({"min_replicas": 0, "look_back_period_s": 1})["metrics_interval_s"] == 0.5
    assert woken_promptly({"min_replicas": 0, "metrics_interval_s": 5})["metrics_interval_s"] == 5  # the user's
    assert "metrics_interval_s" not in woken_promptly({"max_replicas": 2})  # min_replicas 1 by default


def test_serving_from_zero_needs_a_device_training_would_lend() -> None:
    """Under priority training with every device held by the run, a request at zero would wait
    forever: refused before the arbiter starts."""
    pool, job = load_pool(str(POOL), ["pool.units=2", "serving.args.autoscaling.min_replicas=0",
                                      "serving.args.autoscaling.max_replicas=1", "policy.priority=training"])
    with pytest.raises(SpecError, match="a request would wait for a replica forever"):
        Pool(pool, job, 2.0)


def test_the_signals_from_replica_reports() -> None:
    book = LoadBook(ttft_window_s=10)
    book.report("a", ReplicaLoad(4, 6, 30, 40, [0.1] * 9 + [2.0]), now=100)
    book.report("b", ReplicaLoad(2, 0, 10, 40, [0.2] * 10), now=101)
    assert book.signal("queue_length", 101) == 6.0                  # (10 + 2) / 2 replicas
    assert book.signal("kv_occupancy", 101) == 0.5
    assert book.signal("ttft_p90_ms", 101) == pytest.approx(200)    # 18 of 20 samples at most 0.2 s
    assert book.signal("queue_length", 105.5) == 2.0               # a is silent for 5.5 s: gone
    assert book.signal("ttft_p90_ms", 112) is None                  # every sample older than the window
    assert LoadBook(10).signal("queue_length", 0) is None


def test_the_run_size_from_its_events() -> None:
    events = [{"event": "launch"}, {"event": "start", "world_size": 2}]
    assert training_size(events) is None                            # not stepping yet
    events.append({"event": "first_step"})
    assert training_size(events) == 2
    events.append({"event": "preempted"})
    assert training_size(events) is None
    events += [{"event": "launch"}, {"event": "start", "world_size": 1}, {"event": "first_step"}]
    assert training_size(events) == 1


@pytest.mark.parametrize("override, message", [
    ("training.set=[scaling.num_workers=2]", "set scaling.min_workers and scaling.max_workers"),
    ("serving.args.autoscaling=null", "serving.args.autoscaling.max_replicas"),
    ("serving.args.autoscaling.max_replicas=1", "must be above min_replicas"),
    ("pool.units=2", "cannot hold training's min_workers (1) and serving's autoscaling.min_replicas (2)"),
    ("serving.args.num_replicass=1", "unknown key 'num_replicass' (did you mean 'num_replicas'?)"),
    ("serving.args.batching.max_batch_size=0", "batching.max_batch_size: Input should be greater than or equal to 1"),
    ("serving.args.max_batch_size=4", "max_batch_size is batching.max_batch_size"),
    ("serving.args.engine.num_shards=2", "serving.args.engine.num_shards"),
    ("serving.args.checkpoint=/elsewhere", "the pool serves its own run"),
    ("pool.resource=CPU", "pool.resource 'CPU'"),
    ("policy.lend_when.signal=p99", "policy.lend_when.signal"),
    ("policy.cooldown_s=3", "policy.cooldown_s"),
])
def test_a_bad_pool_spec_is_refused_naming_the_key(override: str, message: str) -> None:
    extra = ["serving.args.autoscaling.min_replicas=2", "serving.args.autoscaling.max_replicas=3"] if override.startswith("pool.units") else []
    with pytest.raises(SpecError) as err:
        load_pool(str(POOL), [*extra, override])
    assert message in str(err.value)


def test_the_pool_command_refuses_a_bad_spec_before_starting_anything(tmp_path: Path) -> None:
    done = subprocess.run([SHARDYARD, "pool", str(POOL), "--set", "training.set=[scaling.num_workers=2]"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "the pool lends an elastic run's workers" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_where_the_devices_come_from_is_checked_before_ray_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before `ray.init`: the address given here has nothing listening, and joining it
    would fail only after Ray's connection timeout."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(SpecError, match="leave pool.units out"):
        connect(*load_pool(str(POOL)))
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(SpecError, match="pool.resource GPU: a local Ray instance pools the GPUs of a cluster"):
        connect(*load_pool(str(POOL), ["pool.resource=GPU", "pool.units=null"]))


def test_each_resize_is_a_fixed_size_launch_of_the_same_run() -> None:
    _, job = load_pool(str(POOL))
    one = at_size(job, 1)
    assert (one.scaling.num_workers, one.scaling.min_workers, one.scaling.max_workers) == (1, None, None)
    assert one.scaling.resources_per_worker["device"] == 1.0 and one.run.name == job.run.name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_readmes_pool_command_trains_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`shardyard pool jobs/configs/pool.yaml` as README gives it (the port aside): README's model
    trains on the byte corpus, the app serves text from its first checkpoint, SIGTERM checkpoints
    the run and ends the pool."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    log = tmp_path / "pool.log"
    pool = subprocess.Popen([SHARDYARD, "pool", str(POOL), "--set", f"serving.port={port}"], cwd=tmp_path, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: served(port) or pool.poll() is not None, 240, "the app never served")
        assert pool.poll() is None, log.read_text()[-3000:]
        body = json.dumps({"prompt": "import ", "max_tokens": 8}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert json.loads(answer.read())["choices"][0]["text"]
        assert stop(pool, log) == 143, log.read_text()[-3000:]
    finally:
        if pool.poll() is None:
            os.killpg(pool.pid, signal.SIGKILL)
    run_dir = tmp_path / "runs" / "gpt_pool"
    assert [e["event"] for e in read_events(run_dir)][-1] == "preempted"
    console = log.read_text()
    assert "shardyard pool: no device changed hands" in console
    # Serve's INFO lines (its controller's, proxy's and replicas' starts, the access log) stay in
    # Ray's log files on the pool's own Ray.
    assert "(ServeController" not in console and "(ProxyActor" not in console and "INFO" not in \
        console.replace("INFO worker.py", ""), console[-3000:]


@pytest.mark.ray
@pytest.mark.timeout(420)
def test_an_episode_lends_under_load_and_takes_back_after_losing_nothing(tmp_path: Path) -> None:
    episode = run_episode(tmp_path, "episode", SHAPES["tiny"], port=free_port(), calm_s=0, lent_s=0)
    run_dir = episode["run_dir"]
    assert episode["exit_code"] == 143, episode["log"].read_text()[-3000:]  # stopped by SIGTERM, checkpointed
    events = read_events(run_dir)
    decisions = [e["event"] for e in events if e["event"] in ("lend", "lend_serving", "return", "return_training")]
    assert decisions == ["lend", "lend_serving", "return", "return_training"], events
    # In place (jobs/configs/pool.yaml's scaling.resize): one group start, a worker leaving and one
    # joining at step boundaries; the only stop is the SIGTERM's, and no step ran twice.
    assert [e["world_size"] for e in events if e["event"] == "start"] == [2], events
    assert [e["world_size"] for e in events if e["event"] == "regrouped"] == [1, 2], events
    stops = [e["step"] for e in events if e["event"] == "preempted"]
    assert len(stops) == 1, stops
    assert all(r["status"] == 200 for r in episode["requests"]), [r for r in episode["requests"] if r["status"] != 200]
    assert "ray_shardyard_pool_lends" in episode["metrics"] and "ray_shardyard_pool_returns" in episode["metrics"]
    assert json.loads((run_dir / "pool" / "timeline.json").read_text())

    assert_exact(run_dir, stops[-1], episode_job(tmp_path, "episode", SHAPES["tiny"]))


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_request_wakes_an_app_scaled_to_zero_on_a_device_the_run_lends(tmp_path: Path) -> None:
    """Two devices, training on both while no one asks; twice: a streamed request waits (no error)
    while the run's newest worker leaves and Serve starts a replica on its device, then is
    answered; Serve lets the idle replica go and the run takes the device back (a worker joins,
    its state from a live peer). Nothing lost: one start, exact samples, single-process weights."""
    wakes = run_wakes(tmp_path, "zero", SHAPES["tiny"], port=free_port())
    run_dir, requests = wakes["run_dir"], wakes["requests"]
    assert wakes["exit_code"] == 143, wakes["log"].read_text()[-3000:]
    assert [(r["status"], bool(r["text"])) for r in requests] == [(200, True)] * 4, requests
    events = read_events(run_dir)
    decisions = [e["event"] for e in events if e["event"] in ("lend", "lend_serving", "return", "return_training")]
    assert decisions == ["lend", "lend_serving", "return", "return_training"] * 2, events
    assert all(e["wake"] for e in events if e["event"] == "lend"), events
    assert [e["world_size"] for e in events if e["event"] == "start"] == [2], events
    assert [e["world_size"] for e in events if e["event"] == "regrouped"] == [1, 2, 1, 2], events
    assert "woken from zero" in wakes["log"].read_text()
    stops = [e["step"] for e in events if e["event"] == "preempted"]
    # About 2,700 steps here (two replica starts are waited for): the all-reduce's other order of
    # float sums moves the weights 1.5e-6 from single-process training's by then; a wrong
    # gradient scale at either size would move them by 1e-3 or more a step.
    assert_exact(run_dir, stops[-1], episode_job(tmp_path, "zero", SHAPES["tiny"]), atol=1e-5)


def assert_exact(run_dir: Path, final: int, job_overrides: list[str], atol: float = 1e-6) -> None:
    """Every sample used exactly once at world sizes 1 and 2, and the weights those of
    single-process training to the same step (plain SGD, no clipping) within `atol`."""
    report = audit(run_dir, 192)
    assert report.steps == final and report.exact, report
    assert sorted(set(report.world_sizes)) == [1, 2]
    _, job = load_pool(str(POOL), [f"training.set={json.dumps(job_overrides)}"])
    oracle_spec = at_size(job, 1).model_copy(deep=True)
    oracle_spec.batch.micro_batch_size = oracle_spec.batch.global_batch_size
    torch.manual_seed(oracle_spec.run.seed)
    oracle = single_process(oracle_spec, build_model(oracle_spec.model), torch.device("cpu"))
    steps(oracle, oracle_spec, 0, final)
    trained = load_model(find_latest(run_dir)).state_dict()
    for name, value in oracle.model.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=atol, msg=name)



def flapping_hour(policy: Policy, burst_s: float, restart_s: float = 20.0) -> tuple[int, float]:
    """An hour of one token holder bursting `burst_s` whenever the run is back at full size, through
    the real policy; Serve as the pool sees it (the burst's replica waits for a device, and is let
    go 10 s after the burst), a resize taking `restart_s`. The resizes, and the share of the hour
    training spent restarting."""
    a = Arbitration(policy, min_workers=1, max_workers=2, start_workers=2)
    size, restart_until, burst_until, calm_since, resizes, restarting = 2, 0.0, -1.0, 0.0, 0, 0.0
    for now in range(3600):
        if now >= restart_until and size != a.allotment:
            size = a.allotment
        running = size != a.allotment or now < restart_until
        if not running and size == 2 and now > burst_until + 10:
            burst_until = now + burst_s  # back at full size: burst again
        bursting = now < burst_until
        calm_since = now if bursting else calm_since
        wanted = 2 if bursting or now - calm_since < 10 else 1
        replicas = 1 + (a.lent if not running else 0)
        free = 1 if a.lent and wanted == 1 else 0
        signal = 2 * policy.lend_when.above if bursting else 0.0
        decision = a.observe(Observation(now, signal, min(replicas, wanted), wanted, free,
                                         None if running else size, devices=3))
        if decision is not None:
            resizes += 1
            restart_until = now + restart_s
        restarting += running
    return resizes, restarting / 3600


def test_one_client_bursting_cannot_flap_the_run() -> None:
    """jobs/configs/pool.yaml's policy, an attacker bursting 6 s whenever the run is back at full
    size: 108 resizes an hour before (training restarting 87% of it). A burst shorter than a
    resize costs moves nothing; longer ones are held to the budget, backed off, and dwell."""
    policy = load_pool(str(POOL))[0].policy
    assert flapping_hour(policy, burst_s=6) == (0, 0.0)
    resizes, restarting = flapping_hour(policy, burst_s=30)  # long enough to lend, again and again
    assert 0 < resizes <= 2 * policy.max_lends_per_hour and restarting < 0.15, (resizes, restarting)
