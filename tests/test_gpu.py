"""GPU paths (marked `gpu`, skipped without CUDA): on Hugging Face models, FSDP2 with bf16 compute
and fp32 master weights, and tensor parallelism from the model's own plan over NCCL, against the
fp32 single-process CPU oracle of test_models.py; serving shards that run on their bundles' GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardyard.localdist import run_distributed
from shardyard.spec import parse_spec
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.train.trainer import Trainer
from test_models import MODELS, STEPS, job, oracle
from test_serve_run import save_default_job_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def train_on_gpus(rank: int, world: int, raw: dict) -> None:
    Trainer.build(parse_spec(raw), rank, world, torch.device("cuda", rank)).train()


def update_error(got: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
                 expected: dict[str, torch.Tensor]) -> float:
    """How far the trained parameters are from the oracle's, relative to how far training moved them."""
    off = sum((got[k].float() - expected[k]).norm() ** 2 for k in expected) ** 0.5
    moved = sum((expected[k] - initial[k]).norm() ** 2 for k in expected) ** 0.5
    return float(off / moved)


@pytest.mark.timeout(600)
def test_fsdp2_bf16_trains_a_llama_as_fp32_does(tmp_path: Path) -> None:
    world = min(2, torch.cuda.device_count())
    raw = job(MODELS["llama"], {"strategy": "fsdp", "mixed_precision": True}, world, tmp_path)
    raw["run"]["precision"] = "auto"  # bf16 on GPU
    run_distributed(train_on_gpus, world, raw, backend="nccl")
    trained = load_model(find_latest(tmp_path / "run")).state_dict()
    assert all(v.dtype == torch.float32 for v in trained.values())  # master weights stay fp32
    initial, expected = oracle("llama", STEPS)
    assert update_error(trained, initial, expected) < 0.05


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_llama_on_two_gpus_equals_one_cpu_process(tmp_path: Path) -> None:
    raw = job(MODELS["llama"], {"strategy": "tensor", "tp": 2}, 2, tmp_path)
    raw["run"]["precision"] = "fp32"
    run_distributed(train_on_gpus, 2, raw, backend="nccl")
    trained = load_model(find_latest(tmp_path / "run")).state_dict()
    _, expected = oracle("llama", STEPS)
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-4, msg=name)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharding", ["pipeline", "tensor"])
def test_serving_shards_run_on_their_gpus(ray_cluster, tmp_path: Path, sharding: str) -> None:
    """Each shard actor takes its bundle's GPU (Ray hides it otherwise, and the shard would fall
    back to the CPU); tensor shards then talk over NCCL. Logits equal the CPU model's."""
    import ray

    from shardyard.serve.shards import ShardedModel

    n = min(2, torch.cuda.device_count())
    run_distributed(save_default_job_checkpoint, 1, str(tmp_path / "run"))
    latest = find_latest(tmp_path / "run")
    tokens = torch.randint(0, 256, (2, 16))
    expected = load_model(latest).eval()(tokens)
    sharded = ShardedModel(str(latest), n, use_gpu=True, sharding=sharding)
    try:
        devices = [d["device"] for d in ray.get([s.describe.remote() for s in sharded.shards])]
        got = sharded.forward(tokens)
    finally:
        sharded.close()
    assert all(d.startswith("cuda") for d in devices), devices
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)
