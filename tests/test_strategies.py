"""Every parallel strategy, and each combination that fits in 4 CPU processes, against the oracle:
the same model, data and global batch trained in one process.

Per case, on real torch.distributed (gloo) ranks (all cases of one world size share one launch):
train STEPS steps, saving a checkpoint after
RESUME_AT; then a fresh engine (different random init) loads that checkpoint and trains on.
Checked in the main process:
- final parameters and the per-step loss curve equal the single-process run (tolerance below);
- the resumed run ends exactly where the straight run ended;
- the checkpoint exports to safetensors and reloads in one process with equal outputs.

Tolerances: the only allowed difference is reduction order (all-reduce / reduce-scatter sums
per rank, tensor-parallel partial matmuls, pipeline micro-batch accumulation), amplified a little
by Adam's normalisation; 2e-5 on parameters (about 1% of what 4 steps move them) and 1e-5
relative on losses. Resume is compared at 1e-6: same ranks, same ops, only the checkpoint between.
"""

from __future__ import annotations

import functools
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardyard.localdist import run_distributed
from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.models import build_model
from shardyard.parallel import build_engine, single_process
from shardyard.spec import parse_spec
from shardyard.train import checkpoint
from shardyard.train.checkpoint import TrainState

STEPS, RESUME_AT = 4, 2
PARAM_TOL, LOSS_RTOL, RESUME_TOL = 2e-5, 1e-5, 1e-6


def job(parallelism: dict, world: int, micro_batch: int) -> dict:
    return {
        "model": {"name": "gpt", "n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 16,
                  "tie_weights": parallelism.get("pp", 1) == 1},
        "data": {"name": "synthetic", "num_samples": 256},
        "optim": {"lr": 1e-3, "warmup_steps": 1, "grad_clip": 0.5},
        "batch": {"global_batch_size": 16, "micro_batch_size": micro_batch},
        "parallelism": parallelism,
        "scaling": {"num_workers": world},
        "run": {"steps": STEPS, "seed": 5},
    }


CASES = {
    # id: (parallelism, world size, micro-batch)
    "ddp": ({"strategy": "ddp"}, 2, 4),
    "fsdp": ({"strategy": "fsdp"}, 2, 4),
    "fsdp-accum-ac": ({"strategy": "fsdp", "activation_checkpointing": True}, 2, 2),
    "tensor": ({"strategy": "tensor", "tp": 2}, 2, 4),
    "fsdp-x-tensor": ({"strategy": "fsdp", "tp": 2}, 4, 4),
    "zero1": ({"strategy": "zero1"}, 2, 4),
    "zero2": ({"strategy": "zero2"}, 2, 2),
    "zero3": ({"strategy": "zero3"}, 2, 4),
    "zero2-offload": ({"strategy": "zero2", "cpu_offload": True}, 2, 4),
    "zero3-offload": ({"strategy": "zero3", "cpu_offload": True}, 2, 2),
    "pipeline-gpipe": ({"strategy": "pipeline", "pp": 2, "schedule": "gpipe"}, 2, 4),
    "pipeline-1f1b": ({"strategy": "pipeline", "pp": 2, "schedule": "1f1b"}, 2, 2),
    "pipeline-interleaved": ({"strategy": "pipeline", "pp": 2, "schedule": "interleaved_1f1b",
                              "stages_per_rank": 2}, 2, 2),
    "dp-x-pipeline": ({"strategy": "pipeline", "pp": 2}, 4, 2),
    "fsdp-x-pipeline": ({"strategy": "fsdp", "pp": 2}, 4, 2),
    "pipeline-x-tensor": ({"strategy": "fsdp", "pp": 2, "tp": 2}, 4, 4),
}


def steps(engine, spec, start: int, stop: int) -> list[float]:
    """Train from step `start` to `stop`; return the global mean loss of each step."""
    dataset = build_dataset(spec)
    order = GlobalSampleOrder(len(dataset), spec.run.seed)
    accum = spec.grad_accum_steps(dist.get_world_size() if dist.is_initialized() else 1)
    losses = []
    for step in range(start, stop):
        ids = micro_batch_ids(order, step * spec.batch.global_batch_size, engine.dp_rank,
                              engine.dp_size, spec.batch.micro_batch_size, accum)
        loss = engine.train_step([dataset.batch(i) for i in ids])
        if dist.is_initialized():
            dist.all_reduce(loss)
        losses.append(loss.item() / engine.loss_ranks)
    return losses


def rank_fn(rank: int, world: int, raw: dict, out: str) -> list[float]:
    spec = parse_spec(raw)
    save = lambda engine, step, name: checkpoint.save(  # noqa: E731
        engine, TrainState(step, step * spec.batch.global_batch_size, world), spec, Path(out, name), rank)

    torch.manual_seed(spec.run.seed)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    losses = steps(engine, spec, 0, RESUME_AT)
    save(engine, RESUME_AT, "mid")
    losses += steps(engine, spec, RESUME_AT, STEPS)
    save(engine, STEPS, "straight")

    torch.manual_seed(spec.run.seed + 1)  # a different init: the checkpoint must overwrite it all
    fresh = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    state = checkpoint.load(fresh, Path(out, "mid"))
    assert state.step == RESUME_AT
    steps(fresh, spec, RESUME_AT, STEPS)
    save(fresh, STEPS, "resumed")
    return losses


@functools.cache
def oracle_run(tie_weights: bool, global_batch: int = 16) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS steps in one process on the whole global batch: per-step losses, final parameters."""
    raw = job({"strategy": "ddp"}, 1, global_batch)
    raw["batch"] = {"global_batch_size": global_batch, "micro_batch_size": global_batch}
    spec = parse_spec(raw)
    spec.model.tie_weights = tie_weights
    torch.manual_seed(spec.run.seed)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    losses = steps(engine, spec, 0, STEPS)
    return losses, {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


@pytest.fixture(scope="module")
def oracle() -> dict:
    return {tie: oracle_run(tie) for tie in (True, False)}


def every_case(rank: int, world: int, out: str) -> dict[str, list[float] | str]:
    """Every case of this world size in turn, in one set of processes (a launch costs seconds
    here). A case that raises is reported by name; the others still run."""
    results: dict[str, list[float] | str] = {}
    for case, (parallelism, case_world, micro) in CASES.items():
        if case_world != world:
            continue
        Path(out, case).mkdir(exist_ok=True)
        try:
            results[case] = rank_fn(rank, world, job(parallelism, world, micro), str(Path(out, case)))
        except Exception:  # noqa: BLE001 - reported by the case's own test
            results[case] = traceback.format_exc()
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[float] | str]]:
    """(the directory with one subdirectory per case, rank 0's losses or traceback per case)."""
    out = tmp_path_factory.mktemp("strategies")
    results: dict[str, list[float] | str] = {}
    for world in sorted({world for _, world, _ in CASES.values()}):
        results |= run_distributed(every_case, world, str(out))[0]
    return out, results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_strategy_matches_single_process_and_resumes(case: str, oracle: dict, trained) -> None:
    parallelism, world, micro = CASES[case]
    raw = job(parallelism, world, micro)
    out, results = trained
    losses, tmp_path = results[case], out / case
    assert not isinstance(losses, str), f"{case} raised on rank 0:\n{losses}"
    tie = raw["model"]["tie_weights"]
    oracle_losses, oracle_params = oracle[tie]

    torch.testing.assert_close(torch.tensor(losses), torch.tensor(oracle_losses), rtol=LOSS_RTOL, atol=0)
    straight = checkpoint.load_model(tmp_path / "straight").state_dict()
    for name, value in oracle_params.items():
        torch.testing.assert_close(straight[name], value, rtol=0, atol=PARAM_TOL, msg=f"{case}: {name}")
    resumed = checkpoint.load_model(tmp_path / "resumed").state_dict()
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=RESUME_TOL, msg=f"{case} resume: {name}")

    # Export to one safetensors file and reload it in a single process: same outputs.
    from safetensors.torch import load_model

    exported = checkpoint.export_safetensors(tmp_path / "straight", tmp_path / "model.safetensors")
    reloaded = build_model(parse_spec(raw).model)
    load_model(reloaded, str(exported))
    tokens = torch.randint(0, 256, (2, 16))
    trained = checkpoint.load_model(tmp_path / "straight")
    torch.testing.assert_close(reloaded(tokens), trained(tokens), rtol=0, atol=0)
