"""Local SGD on real gloo ranks: H = 1 with SGD is synchronous data parallelism exactly (the
single-process oracle); with H > 1 the copies drift between averages and agree right after one."""

from __future__ import annotations

import pytest
import torch

from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine, single_process
from shardyard.spec import parse_spec
from helpers.oracle import job, steps

SGD = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01, "grad_clip": 0.0, "warmup_steps": 1}


def local_sgd_job(sync_every: int) -> dict:
    raw = job({"strategy": "local_sgd", "sync_every": sync_every}, 2, 4)
    raw["optim"] = SGD
    raw["checkpoint"] = {"every_n_steps": 4}
    return raw


def params_after_each_step(rank: int, world: int, raw: dict, count: int) -> list[dict[str, torch.Tensor]]:
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    snapshots = []
    for step in range(count):
        steps(engine, spec, step, step + 1)
        snapshots.append({k: v.detach().clone() for k, v in engine.model.state_dict().items()})
    return snapshots


def both_periods(rank: int, world: int) -> dict[int, list[dict[str, torch.Tensor]]]:
    return {h: params_after_each_step(rank, world, local_sgd_job(h), 4) for h in (1, 4)}


@pytest.fixture(scope="module")
def trained() -> list[dict[int, list[dict[str, torch.Tensor]]]]:
    """Per rank, per H: the parameters after each of 4 steps (one launch for both H)."""
    return run_distributed(both_periods, 2)


@pytest.mark.timeout(120)
def test_local_sgd_with_h1_equals_single_process_sgd(trained) -> None:
    ranks = [r[1] for r in trained]
    raw = local_sgd_job(1)
    raw["parallelism"] = {"strategy": "ddp"}
    raw["batch"] = {"global_batch_size": 16, "micro_batch_size": 16}
    raw["scaling"] = {"num_workers": 1}
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    steps(engine, spec, 0, 4)
    for name, value in engine.model.state_dict().items():
        torch.testing.assert_close(ranks[0][-1][name], value, rtol=0, atol=2e-6, msg=name)
        torch.testing.assert_close(ranks[1][-1][name], ranks[0][-1][name], rtol=0, atol=0, msg=name)


@pytest.mark.timeout(120)
def test_local_sgd_copies_drift_between_averages_and_agree_after_one(trained) -> None:
    first, second = (r[4] for r in trained)
    weight = "blocks.0.mlp.fc_in.weight"
    assert not torch.equal(first[2][weight], second[2][weight])  # step 3: local steps only
    for name in first[3]:  # step 4: averaged
        torch.testing.assert_close(first[3][name], second[3][name], rtol=0, atol=0, msg=name)
