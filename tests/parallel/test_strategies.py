"""Every parallel strategy, and each combination that fits in 4 CPU processes, against the oracle:
the same model, data and global batch trained in one process.

Each case runs the real `Trainer` (the loop Ray Train's workers run) on torch.distributed gloo
ranks, all cases of one world size in one launch, and is checked in the main process:
- final parameters and the per-step loss curve equal the single-process run, once with AdamW,
  weight decay (two parameter groups, which every strategy and ZeRO's state conversions must keep
  apart) and gradient clipping, and once with plain SGD, no clipping and no weight decay: Adam's update and
  clipping are blind to a constant gradient factor (a sum instead of a mean over ranks, a missing
  1/accumulation), SGD's is not. Every case has world size > 1 and accumulation > 1;
- a run resumed from the committed checkpoint of step RESUME_AT ends exactly where the straight
  run ended;
- the checkpoint exports to safetensors and reloads in one process with equal outputs.

Tolerances: the only allowed difference is reduction order (all-reduce / reduce-scatter sums
per rank, tensor-parallel partial matmuls, pipeline micro-batch accumulation), amplified a little
by Adam's normalisation; 2e-5 on parameters (about 1% of what 4 steps move them) and 1e-5
relative on losses. Resume is compared at 1e-6: same ranks, same ops, only the checkpoint between.
"""

from __future__ import annotations

import shutil
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec
from shardyard.checkpoint import loaders
from shardyard.checkpoint.loaders import export_safetensors, find_latest, load_model, load_model_part
from shardyard.checkpoint.record import checkpoint_name
from shardyard.train.metrics import read_metrics

from helpers.oracle import (ADAMW_PARAM_TOL, LOSS_RTOL, OPTIMIZERS, ORACLE_GRAD_NORMS, PARAM_TOL, RESUME_AT,
                            RESUME_TOL, SGD, STEPS, job, oracle_run, steps, train, with_storage)

CASES = {
    # id: (parallelism, world size, micro-batch)
    "ddp": ({"strategy": "ddp"}, 2, 4),
    "fsdp": ({"strategy": "fsdp"}, 2, 4),
    "fsdp-accum-ac": ({"strategy": "fsdp", "activation_checkpointing": True}, 2, 2),
    # parallelism.compile: Inductor's fused kernels round differently, within the same tolerance.
    "ddp-compiled": ({"strategy": "ddp", "compile": True}, 2, 4),
    "fsdp-compiled": ({"strategy": "fsdp", "compile": True}, 2, 2),
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


def straight_and_resumed(rank: int, world: int, raw: dict, out: Path, resume: bool = True) -> None:
    """The case straight to STEPS; then a second run that starts from a copy of the straight
    run's committed checkpoint of RESUME_AT and trains on to STEPS. Without the second run, the
    straight one saves its last step only (a DCP save costs more here than the 4 steps)."""
    if not resume:
        train(rank, world, with_storage(raw | {"checkpoint": {**raw["checkpoint"], "every_n_steps": STEPS}},
                                        out / "straight"))
        return
    train(rank, world, with_storage(raw, out / "straight"))
    if rank == 0:
        name = checkpoint_name(RESUME_AT)
        shutil.copytree(out / "straight" / "run" / name, out / "resumed" / "run" / name)
    dist.barrier()
    train(rank, world, with_storage(raw, out / "resumed"))


def every_case(rank: int, world: int, out: str) -> dict[str, str | None]:
    """Every case of this world size in turn, with each optimizer, in one set of processes (a
    launch costs seconds here). A case that raises is reported by name; the others still run."""
    results: dict[str, str | None] = {}
    for case, (parallelism, case_world, micro) in CASES.items():
        if case_world != world:
            continue
        for opt, optim in OPTIMIZERS.items():
            try:
                # Resuming is checked once per case, with AdamW (its state is what must carry over).
                straight_and_resumed(rank, world, job(parallelism, world, micro, optim), Path(out, case, opt),
                                     resume=opt == "adamw")
                results[f"{case}/{opt}"] = None
            except Exception:  # noqa: BLE001 - reported by the case's own test
                results[f"{case}/{opt}"] = traceback.format_exc()
            dist.barrier()
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str | None]]:
    """(the directory with one subdirectory per case, rank 0's traceback per case, if it raised)."""
    out = tmp_path_factory.mktemp("strategies")
    results: dict[str, str | None] = {}
    for world in sorted({world for _, world, _ in CASES.values()}):
        results |= run_distributed(every_case, world, str(out))[0]
    return out, results


def param_tol(optim: str) -> float:
    return ADAMW_PARAM_TOL if optim == "adamw" else PARAM_TOL


def assert_params(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float, what: str) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=tol, msg=f"{what}: {name}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optim", list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(CASES))
def test_strategy_matches_single_process_and_resumes(case: str, optim: str, trained) -> None:
    parallelism, world, micro = CASES[case]
    raw = job(parallelism, world, micro, OPTIMIZERS[optim])
    out, results = trained
    error, case_dir = results[f"{case}/{optim}"], out / case / optim
    assert error is None, f"{case} ({optim}) raised on rank 0:\n{error}"
    oracle_losses, oracle_params = oracle_run(raw["model"]["tie_weights"], optim)

    rows = read_metrics(case_dir / "straight" / "run")
    torch.testing.assert_close(torch.tensor([row["loss"] for row in rows]), torch.tensor(oracle_losses),
                               rtol=LOSS_RTOL, atol=0)
    # The logged gradient norm is the whole model's (every shard's, every rank's), as one process
    # measures it; and each row says what the step cost and held.
    norms = ORACLE_GRAD_NORMS[(raw["model"]["tie_weights"], optim, 16)]
    torch.testing.assert_close(torch.tensor([row["grad_norm"] for row in rows]), torch.tensor(norms),
                               rtol=1e-4, atol=0)
    assert all(row["model_tflops_per_s"] > 0 and row["peak_memory_gib"] > 0 and "mfu" not in row for row in rows)
    straight_dir = find_latest(case_dir / "straight" / "run")
    assert straight_dir.name == checkpoint_name(STEPS)
    straight = load_model(straight_dir).state_dict()
    assert_params(straight, oracle_params, param_tol(optim), case)
    if optim == "adamw":
        resumed = load_model(find_latest(case_dir / "resumed" / "run")).state_dict()
        assert_params(resumed, straight, RESUME_TOL, f"{case} resume")

    # Export to one safetensors file and reload it in a single process: same outputs.
    from safetensors.torch import load_model as load_safetensors

    exported = export_safetensors(straight_dir, case_dir / "model.safetensors")
    reloaded = build_model(parse_spec(raw).model)
    load_safetensors(reloaded, str(exported))
    tokens = torch.randint(0, 256, (2, 16))
    model = load_model(straight_dir)
    torch.testing.assert_close(reloaded(tokens), model(tokens), rtol=0, atol=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("optim", list(OPTIMIZERS))
def test_the_oracle_moves_parameters_far_beyond_the_tolerance(optim: str) -> None:
    """Guards the oracle itself: equality proves nothing unless STEPS steps move the weights, and
    a gradient twice too large must land far outside the tolerance."""
    raw = job({"strategy": "ddp"}, 1, 16, OPTIMIZERS[optim], tie=True)
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    initial = build_model(spec.model).state_dict()
    _, trained = oracle_run(True, optim)
    moved = max((trained[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 100 * PARAM_TOL
    if optim == "sgd":  # the update is linear in the gradient: a doubled one shows
        doubled = parse_spec({**raw, "optim": {**SGD, "lr": 2 * SGD["lr"]}})
        torch.manual_seed(spec.run.seed)
        engine = single_process(doubled, build_model(doubled.model), torch.device("cpu"))
        steps(engine, doubled, 0, STEPS)
        off = max((engine.model.state_dict()[k] - trained[k]).abs().max().item() for k in trained)
        assert off > 100 * PARAM_TOL


def tensor_parallel_part(rank: int, world: int, checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The whole tensors of each rank's tensor-parallel shard, as a serving shard reads it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from shardyard.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (world,))
    part = load_model_part(checkpoint_dir, lambda m: apply_tensor_parallel(m, mesh),
                                      torch.device("cpu"), collective=True)
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in part.state_dict().items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["zero2", "zero3"])
def test_a_serving_part_of_a_zero_checkpoint_is_read_without_the_whole_model(case: str, trained,
                                                                            monkeypatch) -> None:
    """A pipeline stage holding the tied head, and the shards of 2 tensor-parallel ranks, read
    from a ZeRO checkpoint through DeepSpeed's lazy converter: equal to the same parts of the
    whole model, with the whole-model load refused in this process."""
    out, results = trained
    assert results[f"{case}/sgd"] is None, results[f"{case}/sgd"]
    final = find_latest(out / case / "sgd" / "straight" / "run")
    whole = load_model(final)
    expected = whole.pipeline_stage(2, 4).state_dict()

    def whole_model(*_: object) -> None:
        raise AssertionError("a serving part loaded the whole model")

    monkeypatch.setattr(loaders, "load_model", whole_model)
    stage = load_model_part(final, lambda m: m.pipeline_stage(2, 4), torch.device("cpu"))
    got = stage.state_dict()
    assert got.keys() == expected.keys() and "lm_head.weight" in got
    assert_params(got, expected, 0.0, f"{case} stage")
    for rank_tensors in run_distributed(tensor_parallel_part, 2, str(final)):
        assert_params(rank_tensors, whole.state_dict(), 0.0, f"{case} tensor shard")


# ----------------------------------------------------------------------------- any checkpoint, any strategy

# Written at world size 2 and resumed at 4, across the two formats (DCP, DeepSpeed's) and a
# resharding, with AdamW, whose state must carry over. Every DCP strategy writes the same thing
# (whole-model keys through get_state_dict), so each is checked once as the source of a ZeRO run
# and once as the target of one, with both ZeRO code paths (stage 1/2 fragments, stage 3
# partitions) on each side, plus ZeRO to ZeRO (DCP to DCP at another world size is
# test_resharding.py's). Local SGD equals one process only with plain SGD, so its pairs use SGD.
# One untied model, so pipelines fit.
STRATEGIES = {
    "ddp": ({"strategy": "ddp"}, {"strategy": "ddp"}),  # (at 2 ranks, at 4 ranks)
    "fsdp": ({"strategy": "fsdp"}, {"strategy": "fsdp"}),
    "tensor": ({"strategy": "tensor", "tp": 2}, {"strategy": "tensor", "tp": 4}),
    "pipeline": ({"strategy": "pipeline", "pp": 2}, {"strategy": "pipeline", "pp": 2}),
    "local_sgd": ({"strategy": "local_sgd"}, {"strategy": "local_sgd"}),
    "zero1": ({"strategy": "zero1"}, {"strategy": "zero1"}),
    "zero2": ({"strategy": "zero2"}, {"strategy": "zero2"}),
    "zero3": ({"strategy": "zero3"}, {"strategy": "zero3"}),
}
PAIRS = {f"{s}-to-{t}": (s, t, "adamw") for s, t in [
    ("ddp", "zero1"), ("fsdp", "zero3"), ("tensor", "zero3"), ("pipeline", "zero1"),
    ("zero1", "ddp"), ("zero1", "tensor"), ("zero3", "fsdp"), ("zero3", "pipeline"),
    ("zero1", "zero3"), ("zero3", "zero1"), ("zero3", "zero3")]}
PAIRS |= {"local_sgd-to-zero2": ("local_sgd", "zero2", "sgd"), "zero2-to-local_sgd": ("zero2", "local_sgd", "sgd")}


def matrix_job(strategy: str, world: int, optim: str, storage: Path) -> dict:
    parallelism = STRATEGIES[strategy][0 if world == 2 else 1]
    return with_storage(job(parallelism, world, 8 // world, OPTIMIZERS[optim], tie=False), storage)


def write_sources(rank: int, world: int, out: str) -> None:
    for source, optim in sorted({(s, o) for s, _, o in PAIRS.values()}):
        train(rank, world, matrix_job(source, world, optim, Path(out, "sources", f"{source}-{optim}")),
              until=RESUME_AT)


def resume_every_pair(rank: int, world: int, out: str) -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    for pair, (source, target, optim) in PAIRS.items():
        try:
            if rank == 0:
                shutil.copytree(Path(out, "sources", f"{source}-{optim}"), Path(out, pair))
            dist.barrier()
            train(rank, world, matrix_job(target, world, optim, Path(out, pair)))
            results[pair] = None
        except Exception:  # noqa: BLE001 - reported by the pair's own test
            results[pair] = traceback.format_exc()
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str | None]]:
    out = tmp_path_factory.mktemp("matrix")
    run_distributed(write_sources, 2, str(out))
    return out, run_distributed(resume_every_pair, 4, str(out))[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pair", list(PAIRS))
def test_a_checkpoint_resumes_under_another_strategy_at_another_world_size(pair: str, matrix) -> None:
    """Model, optimizer state and schedule carried across: the resumed run ends where one process ends."""
    out, results = matrix
    error = results[pair]
    assert error is None, f"{pair} raised on rank 0:\n{error}"
    _, oracle_params = oracle_run(False, PAIRS[pair][2])
    final = find_latest(out / pair / "run")
    assert final.name == checkpoint_name(STEPS)
    assert_params(load_model(final).state_dict(), oracle_params, param_tol(PAIRS[pair][2]), pair)
