"""One episode of the elastic pool, as `shardyard pool` runs it: a job of the pool's, the pool
started and stopped like a user's, a load generator whose clients change mid-way, and the
episode's record (events, requests, replicas). tests/pool/ checks what it loses (nothing);
benchmarks/pool_episode.py times it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardyard.storage.events import read_events

from helpers.fake_cluster import wait_for
from helpers.repo import REPO, SHARDYARD

CONFIG = REPO / "jobs" / "configs" / "pool.yaml"

GLOBAL_BATCH = 48  # the episode job's; 4 steps an epoch of its 192 samples

SHAPES = {  # the GPT's layers and width, trained and served
    "tiny": ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32"],
    "small": ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=64"],
}


@dataclass
class Load:
    """Clients sending completions one after another; `clients` may change while they run."""
    url: str
    clients: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    stopped: threading.Event = field(default_factory=threading.Event)

    def start(self, most: int) -> None:
        for i in range(most):
            threading.Thread(target=self._client, args=(i,), daemon=True).start()

    def _client(self, index: int) -> None:
        body = json.dumps({"prompt": "def main():", "max_tokens": 16, "temperature": 0}).encode()
        while not self.stopped.is_set():
            if index >= self.clients:
                time.sleep(0.05)
                continue
            began = time.time()
            request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    status = answer.status
                    answer.read()
            except urllib.error.HTTPError as err:
                status = err.code
            except OSError:
                status = 0
            self.requests.append({"start": began, "end": time.time(), "status": status, "clients": self.clients})

    def served_since(self, t: float) -> int:
        return sum(1 for r in list(self.requests) if r["start"] >= t and r["status"] == 200)


def episode_job(storage: Path, name: str, shape: list[str], resize: str = "in_place") -> list[str]:
    """The pool's training job: trained until stopped, on synthetic data (an epoch of 4 steps, so
    the sample ledger sees many), with plain SGD (what the test's oracle can check exactly);
    `resize`: how the run changes size (scaling.resize)."""
    return [f"run.name={name}", f"checkpoint.storage_path={storage}", "run.steps=100000", "data.name=synthetic",
            "data.num_samples=192", f"batch.global_batch_size={GLOBAL_BATCH}", "batch.micro_batch_size=8",
            "checkpoint.every_n_steps=20", "checkpoint.keep=3", "run.log_every=10", "run.sample_ledger=true",
            "optim.name=sgd", "optim.grad_clip=0", "optim.schedule=constant", "optim.lr=0.02",
            "scaling.num_workers=null", "scaling.min_workers=1", "scaling.max_workers=2",
            "scaling.resources_per_worker={CPU: 0.5}", f"scaling.resize={resize}", *shape]


def start_pool(storage: Path, name: str, shape: list[str], priority: str, port: int, signal_: str,
               above: float, cool_down_s: float, log: Path, resize: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    overrides = [f"training.set={json.dumps(episode_job(storage, name, shape, resize))}", f"serving.port={port}",
                 f"policy.priority={priority}",
                 f"policy.lend_when.signal={signal_}", f"policy.lend_when.above={above}",
                 "policy.lend_when.for_s=2", f"policy.cool_down_s={cool_down_s}",
                 # One lend and one return, timed: the bounds against flapping (a breach as long as a
                 # resize, dwell, budget) would only add their waits (tests/pool/test_pool.py holds them).
                 "policy.resize_cost_s=0", "policy.min_dwell_s=0", "serving.args.autoscaling.downscale_delay_s=3",
                 "serving.args.autoscaling.upscale_delay_s=1", "serving.args.autoscaling.look_back_period_s=11", "serving.args.batching.max_batch_size=2",
                 *extra]
    command = [SHARDYARD, "pool", str(CONFIG)] + [a for o in overrides for a in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local instance with the pool's devices
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def waiter(pool: subprocess.Popen, log: Path, timeout_s: float) -> Any:
    """`until(condition, message, limit=timeout_s)`: wait for the condition while the pool runs."""
    def alive() -> None:
        if pool.poll() is not None:
            raise RuntimeError(f"the pool exited ({pool.returncode}); see {log}:\n{log.read_text()[-3000:]}")

    def until(condition: Any, message: str, limit: float = timeout_s) -> None:
        wait_for(lambda: alive() or condition(), limit, f"{message}; see {log}")
    return until


def event(run_dir: Path, kind: str, after: float = 0.0) -> dict[str, Any] | None:
    return next((e for e in read_events(run_dir) if e["event"] == kind and e["time"] >= after), None)


def stop(pool: subprocess.Popen, log: Path, timeout_s: float = 120) -> int:
    """SIGTERM: the run checkpoints and stops, the app is deleted."""
    pool.send_signal(signal.SIGTERM)
    try:
        return pool.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(pool.pid, signal.SIGKILL)
        raise TimeoutError(f"the pool did not stop on SIGTERM; see {log}") from None


def run_episode(storage: Path, name: str, shape: list[str], port: int = 8000, priority: str = "serving",
                schedule: dict[str, float] | None = None, peak_clients: int = 6, timeout_s: float = 300,
                signal_: str = "queue_length", above: float = 3.0, cool_down_s: float = 3.0,
                calm_s: float = 10.0, lent_s: float = 20.0, resize: str = "in_place") -> dict[str, Any]:
    """Run one episode; with `schedule` (phase lengths of an earlier episode), the same load by the
    clock instead of by the pool's events. The calm phase lasts at least `calm_s`, and the peak at
least `lent_s` once the lent replica serves (phase lengths for the figures, not for correctness);
`resize`: the run's scaling.resize.
    Returns the run directory, the phases, the requests and the app's /metrics text at the end."""
    log = storage / f"{name}.log"
    pool = start_pool(storage, name, shape, priority, port, signal_, above, cool_down_s, log, resize)
    run_dir = storage / name
    load = Load(f"http://127.0.0.1:{port}/v1/completions")
    load.start(peak_clients)
    phases: dict[str, float] = {}
    shown = {"metrics": ""}

    until = waiter(pool, log, timeout_s)
    try:
        until(lambda: event(run_dir, "first_step") and served(port), "serving never came up")
        phases["calm"] = time.time()
        load.clients = 1
        until(lambda: load.served_since(phases["calm"]) >= 5, "no request answered while calm")
        time.sleep(max(0.0, (schedule["calm"] if schedule else calm_s) - (time.time() - phases["calm"])))
        phases["peak"] = time.time()
        load.clients = peak_clients
        if schedule:
            time.sleep(schedule["lent"])
            phases["lent"] = time.time()
            time.sleep(schedule["peak"] - schedule["lent"])
        else:
            until(lambda: event(run_dir, "lend_serving"), "serving never got a lent device")
            phases["lent"] = time.time()
            until(lambda: load.served_since(phases["lent"]) >= 4 * peak_clients, "the lent replica answered nothing")
            time.sleep(max(0.0, lent_s - (time.time() - phases["lent"])))
        phases["after"] = time.time()
        load.clients = 1
        if schedule:
            time.sleep(schedule["after"])
        else:
            until(lambda: event(run_dir, "return_training"), "training never took its device back")
            # The app's metrics show both decisions (Ray exports them every few seconds).
            until(lambda: all(f"ray_shardyard_pool_{kind}" in scraped(port, shown) for kind in ("lends", "returns")),
                  "the app's metrics never showed the pool's", 60)
        phases["end"] = time.time()
    finally:
        load.stopped.set()
        code = stop(pool, log) if pool.poll() is None else pool.returncode
    return {"run_dir": run_dir, "phases": phases, "requests": load.requests, "exit_code": code, "log": log,
            "metrics": shown["metrics"]}


def scraped(port: int, into: dict[str, str]) -> str:
    """The app's /metrics text (kept in `into`), or "" while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            into["metrics"] = answer.read().decode()
    except OSError:
        return ""
    return into["metrics"]


def served(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as answer:
            return answer.status == 200
    except OSError:
        return False


# A pool that serves down to zero: 2 devices, training on both while no one asks; a request wakes
# one replica on a device the run lends (its newest worker leaving), and once Serve has let the
# replica go (3 s idle) and 3 s have passed calm, the run takes the device back.
FROM_ZERO = ("pool.units=2", "serving.args.autoscaling.min_replicas=0", "serving.args.autoscaling.max_replicas=1")
# The same app scaled to zero beside a device no one holds (3 devices, training on at most 2):
# Serve's own cold start, with no lend.
FREE_DEVICE = ("pool.units=3", "serving.args.autoscaling.min_replicas=0", "serving.args.autoscaling.max_replicas=1")


def streamed(url: str, timeout_s: float = 120) -> dict[str, Any]:
    """One streamed completion: its status, when its answer began and its first token came."""
    body = json.dumps({"prompt": "def main():", "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    began = time.time()
    record: dict[str, Any] = {"start": began, "status": 0, "first_token_s": None, "text": ""}
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            record["status"] = answer.status
            for line in answer:
                if line.startswith(b"data: {"):
                    record["first_token_s"] = record["first_token_s"] or time.time() - began
                    record["text"] += json.loads(line[6:])["choices"][0]["text"]
    except urllib.error.HTTPError as err:
        record["status"] = err.code
    record["end"] = time.time()
    return record


def run_wakes(storage: Path, name: str, shape: list[str], port: int = 8000, wakes: int = 2,
              pool_overrides: tuple[str, ...] = FROM_ZERO, timeout_s: float = 240) -> dict[str, Any]:
    """Wake an app scaled to zero `wakes` times: one streamed request (timed), then one more to the
    replica it woke; then, the device lent, wait until the run has it back (Serve let the replica
    go, so the app is at zero again). Returns the run directory, the
    requests ({"wake": n, "warm": bool, ...}) and the pool's exit code. Beside a free device
    (FREE_DEVICE) nothing is lent or returned, so only one wake is seen to begin at zero."""
    if wakes > 1 and pool_overrides != FROM_ZERO:
        raise ValueError("only a lend's return shows the app back at zero: one wake beside a free device")
    log = storage / f"{name}.log"
    pool = start_pool(storage, name, shape, "serving", port, "queue_length", 3.0, 3.0, log, "in_place",
                      extra=pool_overrides)
    run_dir, url = storage / name, f"http://127.0.0.1:{port}/v1/completions"
    requests: list[dict[str, Any]] = []

    until = waiter(pool, log, timeout_s)
    try:
        until(lambda: event(run_dir, "first_step") and "shardyard pool: serving app" in log.read_text(),
              "the app was never deployed")
        for wake in range(wakes):
            requests.append({"wake": wake, "warm": False, **streamed(url)})
            requests.append({"wake": wake, "warm": True, **streamed(url)})
            if pool_overrides == FROM_ZERO:  # at zero again: the replica let go, the device back in training
                after = requests[-1]["end"]
                until(lambda: event(run_dir, "return_training", after), "serving never went back to zero")
    finally:
        code = stop(pool, log) if pool.poll() is None else pool.returncode
    return {"run_dir": run_dir, "requests": requests, "exit_code": code, "log": log}
