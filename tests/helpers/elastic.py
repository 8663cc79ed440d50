"""Elastic runs on the session's cluster: worker nodes started and killed beside it, the run's
events, and the checks that a run which changed world size trained exactly as one process would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import ray
import torch
from helpers.fake_cluster import wait_for

from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.data.ledger import audit
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import load_spec
from shardyard.storage.events import read_events
from shardyard.train.metrics import read_metrics

from helpers.oracle import steps
from helpers.repo import DEFAULT_JOB, RAY, VISION_JOB

SLOT = "elastic_test_slot"


NUM_SAMPLES, GLOBAL_BATCH, EVERY = 192, 48, 25  # 4 steps per epoch; 48 = 4 x 12 = 3 x 16 = 2 x 24


class WorkerNode:
    """One extra Ray node on this machine with `slots` worker slots."""

    def __init__(self, gcs_address: str, slots: int, log: Path) -> None:
        self.label = f"elastic_test_node_{log.stem}"  # a resource that names this node alone
        self.proc = subprocess.Popen(
            [RAY, "start", f"--address={gcs_address}", "--block", "--node-ip-address=127.0.0.1",
             f"--num-cpus={slots}", f"--resources={json.dumps({SLOT: slots, self.label: 1})}",
             "--disable-usage-stats"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self.alive, 60, f"node did not join; see {log}")

    def alive(self) -> bool:
        return any(n["Alive"] and self.label in n["Resources"] for n in ray.nodes())

    def training_workers(self) -> list[psutil.Process]:
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if "RayTrainWorker" in " ".join(p.cmdline())]

    def kill(self) -> None:
        """The node dies: its training worker first (SIGKILL, no cleanup), then the node, which
        shuts down on SIGTERM. (Stopping the node first would let it drain for up to 30 s while
        the run carries on on it.)"""
        for worker in self.training_workers():
            worker.send_signal(signal.SIGKILL)
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """End of test: a graceful stop, so that the cluster forgets the node at once (a node
        killed outright is only noticed after missed health checks, and loaded the cluster enough
        for the next test's node to time out joining)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def events(run_dir: Path) -> list[dict]:
    return read_events(run_dir)


# The job file each task's runs start from: README's GPT, or the example of a task of the user's own.
CONFIGS = {"gpt": DEFAULT_JOB, "vision": VISION_JOB}
SHAPES = {
    "gpt": ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=16", "data.name=synthetic",
            f"data.num_samples={NUM_SAMPLES}"],
    "vision": ["model.options={channels: 4, size: 8}", f"data.options={{num_samples: {NUM_SAMPLES}, size: 8}}",
               "eval.every_n_steps=null", "data.validation_options=null", "metrics=null",
               # Plain SGD (AdamW hides a wrong gradient scale), at a rate where the reduction
               # order's rounding cannot cross 1e-5. Sooner or later the CNN's ReLUs and max-pools
               # meet a choice that a rounding difference of 1e-7 flips, and the parameters then
               # move by about the rate times one sample's gradient: the hot test's 600 steps at
               # rate 0.01 jumped from 1e-7 to 1.3e-4 at step 323 under a steady quorum, every
               # replica equal to the others and every step's samples one process's; at 0.05, 2e-4
               # and 2e-5 in CI. At 5e-4 a flip moves them about 6e-6, while averaging the hot
               # test's 2-replica steps over 3 ends 2.6e-3 away and one skipped batch 5e-5.
               "optim.name=sgd", "optim.lr=0.0005", "optim.grad_clip=0"],
}


def job(storage: Path, name: str, strategy: str, steps: int, task: str = "gpt") -> list[str]:
    return [*SHAPES[task], f"batch.global_batch_size={GLOBAL_BATCH}", "batch.micro_batch_size=4",
            "optim.schedule=constant", f"run.steps={steps}", f"run.log_every={EVERY}",
            f"checkpoint.every_n_steps={EVERY}", "run.sample_ledger=true",
            f"parallelism.strategy={strategy}",
            "scaling.num_workers=null", "scaling.min_workers=2", "scaling.max_workers=4",
            f"scaling.resources_per_worker={{CPU: 1, {SLOT}: 1}}", "scaling.max_failures=3",
            "scaling.resize_check_interval_s=2", "scaling.worker_start_timeout_s=20",
            f"checkpoint.storage_path={storage}", f"run.name={name}"]


def check_run(run_dir: Path, world_sizes: list[int], total_steps: int, task: str = "gpt") -> None:
    """Shared checks: resize history, exact data, constant global batch, close to one process."""
    starts = [e for e in events(run_dir) if e["event"] == "start"]
    assert [e["world_size"] for e in starts] == world_sizes, events(run_dir)
    for before, after in zip(starts, starts[1:]):
        assert after["old_world_size"] == before["world_size"]
        # A group that grows before the first checkpoint starts over; any other restart resumes.
        assert after["restored_step"] > 0 or after["world_size"] > before["world_size"], starts
    assert all(e["global_batch"] == GLOBAL_BATCH for e in starts)

    report = audit(run_dir, NUM_SAMPLES)
    assert report.steps == total_steps and report.exact, report
    assert sorted(set(report.world_sizes)) == sorted(set(world_sizes))
    assert report.complete_epochs == total_steps * GLOBAL_BATCH // NUM_SAMPLES
    assert_matches_single_process(run_dir, total_steps, task=task)


def assert_matches_single_process(run_dir: Path, total_steps: int, loss_rtol: float = 1e-5, task: str = "gpt") -> None:
    spec = load_spec(CONFIGS[task], job(run_dir.parent, "oracle", "ddp", total_steps, task) + [
        "scaling.min_workers=null", "scaling.max_workers=null", "scaling.num_workers=1",
        f"batch.micro_batch_size={GLOBAL_BATCH}"])
    torch.manual_seed(spec.run.seed)
    oracle = single_process(spec, build_model(spec.model), torch.device("cpu"))
    oracle_losses = steps(oracle, spec, 0, total_steps)
    last = [m for m in read_metrics(run_dir) if m["step"] == total_steps][-1]
    assert last["loss"] == pytest.approx(sum(oracle_losses[-EVERY:]) / EVERY, rel=loss_rtol)
    trained = load_model(find_latest(run_dir), trust_factory=getattr(spec.model, "factory", None)).state_dict()
    expected = oracle.model.state_dict()
    print(f"largest difference from one process: {max((trained[n] - v).abs().max().item() for n, v in expected.items()):.2e}")
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-5, msg=lambda message: f"{name}: {message}")
