"""Serving's dtype (serve/executor/precision.py): what `auto` means where, the cast a model is loaded
through, and the engine decoding a bfloat16 model exactly as that model decodes alone without a
cache (the one dtype besides float32 a CPU runs well; float16 is a GPU's, in tests/test_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardyard.serve.executor.precision import cast_for_serving, serving_dtype, stored_dtype
from helpers.models import save_llama
from helpers.engine import decodes_as_without_a_cache

pytestmark = pytest.mark.timeout(120)


def with_dtype(directory: Path, name: str | None, key: str = "dtype") -> Path:
    config = json.loads((directory / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    if name is not None:
        config[key] = name
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_auto_is_float32_on_a_cpu_and_the_checkpoints_16_bit_type_on_a_gpu(tmp_path: Path,
                                                                             ddp_checkpoint: Path) -> None:
    llama = save_llama(tmp_path / "llama")
    for stored, on_gpu in (("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.bfloat16)):
        with_dtype(llama, stored)
        assert stored_dtype(llama) == getattr(torch, stored)
        assert serving_dtype("auto", use_gpu=False, checkpoint=llama) == torch.float32
        assert serving_dtype("auto", use_gpu=True, checkpoint=llama) == on_gpu
    with_dtype(llama, "float16", key="torch_dtype")  # the key transformers wrote before 4.56
    assert serving_dtype("auto", use_gpu=True, checkpoint=llama) == torch.float16
    with_dtype(llama, None)
    assert stored_dtype(llama) == torch.float32
    # A run's checkpoint holds float32 master weights: bfloat16 on a GPU.
    assert stored_dtype(ddp_checkpoint) == torch.float32
    assert serving_dtype("auto", use_gpu=True, checkpoint=ddp_checkpoint) == torch.bfloat16
    for name in ("float32", "bfloat16", "float16"):  # asked for: as asked, anywhere
        assert serving_dtype(name, use_gpu=False, checkpoint=llama) == getattr(torch, name)


def test_a_model_cast_for_serving_keeps_its_ties_and_its_float32_rotary_frequencies(tmp_path: Path) -> None:
    from shardyard.checkpoint.pretrained import PretrainedWeights
    from shardyard.models import build_model
    from shardyard.spec import HFSpec

    directory = save_llama(tmp_path / "llama", tie_word_embeddings=True)
    model = build_model(HFSpec(path=str(directory)), PretrainedWeights(directory))
    cast_for_serving(model, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    assert model.hf.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source,compiled", [("run checkpoint", False), ("llama directory", False),
                                             ("llama directory", True)])
def test_a_bfloat16_model_served_in_process_decodes_as_the_same_model_without_a_cache(
        tmp_path: Path, ddp_checkpoint: Path, source: str, compiled: bool) -> None:
    """LocalModel loads the weights straight into bfloat16 (a run's DCP checkpoint, a model
    directory's safetensors: equal to the float32 model cast), its KV cache holds bfloat16 keys and
    values, and every token the engine gives a greedy request (packed passes for the Llama; its
    decode steps compiled too) is the one the same bfloat16 model picks from that request's tokens
    without a cache, or one whose logit is within bfloat16's rounding of it: logits of 8-bit
    mantissas tie, and a batch of another size rounds them otherwise (token for token equality is
    test_engine.py's, in float32)."""
    if source == "llama directory":
        directory = str(save_llama(tmp_path / "llama", initializer_range=0.5))
    else:
        directory = str(ddp_checkpoint)
    decodes_as_without_a_cache(directory, torch.bfloat16, use_gpu=False, compile_for=2 if compiled else 0)


def test_bfloat16_on_a_cpu_that_emulates_it_is_named_the_slow_choice(tmp_path: Path, monkeypatch) -> None:
    from shardyard.serve.executor import precision

    listing = "processor\t: 0\nflags\t\t: fpu sse2 avx2 {}\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 {}\n"
    for extra, native in (("avx512f avx512_bf16", True), ("amx_bf16 amx_tile", True), ("avx512f", False)):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(listing.format(extra, extra))
        assert precision.native_bfloat16_cpu(cpuinfo) is native
    assert precision.native_bfloat16_cpu(tmp_path / "absent") is None
    assert precision.native_bfloat16_cpu(tmp_path / "cpuinfo") is False
    monkeypatch.setattr(precision, "native_bfloat16_cpu", lambda: False)
    assert "emulated on this CPU" in precision.described(torch.bfloat16, use_gpu=False)
    assert precision.described(torch.bfloat16, use_gpu=True) == "bfloat16"
    assert precision.described(torch.float32, use_gpu=False) == "float32"
    monkeypatch.setattr(precision, "native_bfloat16_cpu", lambda: True)
    assert precision.described(torch.bfloat16, use_gpu=False) == "bfloat16"
