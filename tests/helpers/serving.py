"""Checkpoints that serving tests load: small GPTs trained two steps by several strategies, and
what README's default training job leaves behind."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import requests
import torch

from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.spec import load_spec

from helpers.oracle import job, train, with_storage
from helpers.repo import REPO

STRATEGIES = ("ddp", "fsdp", "zero2")


def train_and_save(rank: int, world: int, out: str, strategies: tuple[str, ...] = STRATEGIES) -> None:
    """Each strategy in turn, in one pair of processes (a launch costs seconds here): the
    Trainer stopped after its committed checkpoint of step 2."""
    for strategy in strategies:
        train(rank, world, with_storage(job({"strategy": strategy}, 2, 4), Path(out, strategy)), until=2)


def save_default_job_checkpoint(rank: int, world: int, run_dir: str, overrides: tuple[str, ...] = ()) -> None:
    """What README's default training job leaves in runs/gpt_ddp (untrained weights: serving
    does not care how good they are), with `overrides` (`--set` pairs) applied to its spec."""
    spec = load_spec(REPO / "jobs" / "configs" / "gpt_ddp.yaml", overrides)
    torch.manual_seed(spec.run.seed)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    CheckpointManager(run_dir, keep=1).save(engine, TrainState(0, 0, world), spec)


TOKEN = "s3cret-of-this-test"

HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def metric(url: str, series: str, app: str, until: Callable[[float], bool] = lambda v: True,
           timeout_s: float = 90) -> float:
    """An app's series in /metrics (Ray's export: `ray_` + the name), summed over its replicas,
    once `until` holds for it. Ray's agents publish every few seconds: the value is waited for."""
    return metrics(url, [series], app, lambda values: until(values[series]), timeout_s)[series]


def metrics(url: str, series: Sequence[str], app: str, until: Callable[[dict[str, float]], bool],
            timeout_s: float = 90) -> dict[str, float]:
    """Several of an app's series, each summed over its replicas, from one scrape of /metrics (a
    replica publishes its numbers together, so one scrape's describe one moment), once every one
    is there and `until` holds for them."""
    pattern = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$', re.M)
    deadline = time.monotonic() + timeout_s
    while True:
        text = requests.get(f"{url}/metrics", headers=HEADERS, timeout=30).text
        values: dict[str, float] = {}
        for name, labels, value in pattern.findall(text):
            if name in series and f'application="{app}"' in labels:
                values[name] = values.get(name, 0.0) + float(value)
        if len(values) == len(series) and until(values):
            return values
        assert time.monotonic() < deadline, f"{', '.join(series)} of {app}: {values or 'absent'}"
        time.sleep(1)
