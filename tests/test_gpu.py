"""GPU paths (marked `gpu`, skipped without CUDA): on Hugging Face models, FSDP2 with bf16 compute
and fp32 master weights, and tensor parallelism from the model's own plan over NCCL, against the
fp32 single-process CPU oracle of test_models.py; serving shards that run on their bundles' GPUs; the
in-replica decoding engine over a model on the GPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from shardyard.localdist import run_distributed
from shardyard.spec import parse_spec
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.train.trainer import Trainer
from helpers.engine import alone, fresh, serve_all
from helpers.models import MODELS, STEPS, job, oracle
from helpers.serving import train_and_save
from helpers.serving import save_default_job_checkpoint
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

    from shardyard.serve.executor.shards import ShardedModel

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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("paged", [True, False])
def test_a_model_decoded_in_the_replicas_process_on_the_gpu_gives_each_request_its_tokens_alone(
        tmp_path: Path, paged: bool) -> None:
    """A one-shard app's model on the replica's GPU (serve/executor/local_model.py with use_gpu): its passes
    run there, its picks come back to the CPU (where the draws' generators are), and the engine's
    greedy and seeded requests, decoded together through the KV cache (attention reading its blocks
    in place with FlexAttention's GPU kernel, the default there, or over lanes), get the tokens each
    would get decoded alone by the same model on the GPU without a cache."""
    from shardyard.serve.engine.decoding import DecodingEngine, TokenBudget
    from shardyard.serve.executor.local_model import LocalModel

    run_distributed(train_and_save, 2, str(tmp_path), ("ddp",))
    run = tmp_path / "ddp" / "run"
    local = LocalModel(str(run), use_gpu=True, cache_blocks=3, paged=paged)
    try:
        assert local.device.type == "cuda" and not local.cache.lane_keys
        model = load_model(find_latest(run)).eval().to(local.device)  # the reference, on the same GPU
        engine = DecodingEngine(local.forward, 3, local.block_size, 3, TokenBudget(8, 60.0, 4), lambda: None, (),
                                executor=local.executor)
        got = asyncio.run(serve_all(engine, fresh(), join_after=3))
        assert bool(local.cache.lane_keys) != paged
    finally:
        local.close()
    assert got == alone(model)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("paged", [True, False])
def test_decode_steps_replayed_as_cuda_graphs_give_each_request_its_tokens_alone(tmp_path: Path, paged: bool) -> None:
    """The one-shard model on the GPU with its decode steps compiled and replayed as CUDA graphs
    (`reduce-overhead` over the fixed KV cache; FlexAttention over the blocks traced into the graph,
    or lanes): greedy and seeded requests get the tokens each gets decoded alone without a cache,
    and the decode steps ran compiled."""
    from shardyard.serve.executor.local_model import LocalModel
    from helpers.engine import served_compiled
    run_distributed(train_and_save, 2, str(tmp_path), ("ddp",))
    run = tmp_path / "ddp" / "run"
    local = LocalModel(str(run), use_gpu=True, cache_blocks=3, compile_for=3, paged=paged)
    assert local.decode.mode == "reduce-overhead"
    model = load_model(find_latest(run)).eval().to(local.device)
    assert served_compiled(local) == alone(model)


@pytest.mark.timeout(300)
def test_a_model_directory_served_on_the_gpu_with_dtype_auto_decodes_in_bfloat16(tmp_path: Path) -> None:
    """`dtype: auto` on a GPU serves a float32 model directory in bfloat16 (serve/executor/precision.py):
    weights and KV cache in bfloat16 on the GPU, rows sampled there (one transfer of ids per pass),
    each greedy token the same bfloat16 model's pick without a cache, within bfloat16's rounding."""
    from shardyard.serve.executor.precision import serving_dtype
    from helpers.models import save_llama
    from helpers.engine import decodes_as_without_a_cache
    directory = str(save_llama(tmp_path / "llama", initializer_range=0.5))
    dtype = serving_dtype("auto", use_gpu=True, checkpoint=directory)
    assert dtype == torch.bfloat16
    decodes_as_without_a_cache(directory, dtype, use_gpu=True)


def fsdp_losses(raw: dict, precision: str, compile_blocks: bool, storage: Path) -> list[float]:
    from shardyard.train.metrics import read_metrics

    world = min(2, torch.cuda.device_count())
    raw = {**raw, "parallelism": {"strategy": "fsdp", "compile": compile_blocks}, "scaling": {"num_workers": world},
           "checkpoint": {**raw["checkpoint"], "storage_path": str(storage)},
           "run": {**raw["run"], "precision": precision, "steps": 8}}
    raw["batch"] = {"global_batch_size": 8, "micro_batch_size": 8 // (2 * world)}
    run_distributed(train_on_gpus, world, raw, backend="nccl")
    return [row["loss"] for row in read_metrics(storage / "run")]


@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 needs compute capability 8.9+")
def test_float8_and_compiled_fsdp_train_a_llama_as_bf16_does(tmp_path: Path) -> None:
    """run.precision float8 (torchao's float8 linears) and parallelism.compile, each against
    eager bf16 FSDP2 on the same model, data and steps: the loss curves agree within 2%."""
    raw = job(MODELS["llama"], {"strategy": "fsdp"}, 1, tmp_path)
    bf16 = fsdp_losses(raw, "bf16", False, tmp_path / "bf16")
    assert bf16[-1] < bf16[0]
    for precision, compile_blocks in (("float8", False), ("bf16", True), ("float8", True)):
        got = fsdp_losses(raw, precision, compile_blocks, tmp_path / f"{precision}-{compile_blocks}")
        torch.testing.assert_close(torch.tensor(got), torch.tensor(bf16), rtol=0.02, atol=0,
                                   msg=f"{precision}, compile={compile_blocks}")
