"""DDP and gradient accumulation equal single-process training on the same global batch.

Oracle: one process, one model, the whole global batch. DDP over W ranks with micro-batch B and
A accumulation steps must end at the same parameters after K steps. The tolerance (1e-5) covers
only summation order: DDP averages per-rank gradients, the oracle averages per-sample ones.
"""

from __future__ import annotations

import pytest
import torch

from shardyard.layout.world_size import grad_accum_steps
from shardyard.localdist import run_distributed
from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.models import build_model
from shardyard.parallel import build_engine, single_process
from shardyard.spec import parse_spec

STEPS = 4
TOL = 1e-5


def tiny_spec(global_batch: int, micro_batch: int, world_size: int) -> dict:
    return {
        "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
        "data": {"name": "synthetic", "num_samples": 256},
        "optim": {"lr": 1e-3, "warmup_steps": 1, "grad_clip": 0.5},
        "batch": {"global_batch_size": global_batch, "micro_batch_size": micro_batch},
        "scaling": {"num_workers": world_size},
        "run": {"steps": STEPS, "seed": 3},
    }


def train(rank: int, world_size: int, raw: dict, strategy) -> dict[str, torch.Tensor]:
    """The loop's math without Ray: same data sharding, same engine, K optimizer steps."""
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    engine = strategy(spec, build_model(spec.model), torch.device("cpu"))
    dataset = build_dataset(spec)
    order = GlobalSampleOrder(len(dataset), spec.run.seed)
    accum = grad_accum_steps(spec, world_size)
    seen = 0
    for _ in range(STEPS):
        ids = micro_batch_ids(order, seen, rank, world_size, spec.batch.micro_batch_size, accum)
        engine.train_step([dataset.batch(i) for i in ids])
        seen += spec.batch.global_batch_size
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def ddp_rank(rank: int, world_size: int, raw: dict) -> dict[str, torch.Tensor]:
    return train(rank, world_size, raw, build_engine)


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=TOL, msg=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro_batch, accum", [(4, 1), (2, 2)])
def test_ddp_two_ranks_equal_one_process(micro_batch: int, accum: int) -> None:
    """2 ranks x micro-batch B (x accum) == 1 process x 2B (x accum)."""
    global_batch = 2 * micro_batch * accum
    oracle = train(0, 1, tiny_spec(global_batch, global_batch, 1), single_process)
    ranks = run_distributed(ddp_rank, 2, tiny_spec(global_batch, micro_batch, 2))
    assert_same_params(ranks[0], ranks[1])  # replicas stay identical
    assert_same_params(ranks[0], oracle)


@pytest.mark.timeout(60)
def test_gradient_accumulation_equals_one_big_step() -> None:
    """2 micro-steps of B in one process == one step of 2B."""
    accumulated = train(0, 1, tiny_spec(8, 4, 1), single_process)
    one_step = train(0, 1, tiny_spec(8, 8, 1), single_process)
    assert_same_params(accumulated, one_step)


@pytest.mark.timeout(60)
def test_training_moves_parameters() -> None:
    """Guards the oracle itself: K steps must change the weights, or equality proves nothing."""
    spec = parse_spec(tiny_spec(8, 8, 1))
    torch.manual_seed(spec.run.seed)
    initial = build_model(spec.model).state_dict()
    trained = train(0, 1, tiny_spec(8, 8, 1), single_process)
    moved = max((trained[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 100 * TOL
