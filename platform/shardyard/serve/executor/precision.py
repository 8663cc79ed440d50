"""The dtype a served model's weights are held in, and so its KV cache (which takes the dtype of the
keys and values the model computes): vLLM's `dtype` setting, by name and meaning.

`auto` on a GPU serves a model in the checkpoint's own 16-bit type: float16 for a float16 model
directory, bfloat16 for a bfloat16 one and for everything stored in float32 (a training run's
master weights; bfloat16 keeps float32's range, float16 does not). On a CPU `auto` is float32:
results equal training's own forward pass, on any CPU. bfloat16 on a CPU reads half the bytes
per weight; on CPUs with AVX-512 BF16 (or AMX) it is the faster choice for decoding, and it is
what vLLM's CPU build takes for `auto` (docs/serving.md has the measurement).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shardyard.checkpoint.layout import is_hf_directory

from shardyard.serve.config import DtypeName
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def stored_dtype(checkpoint: str | Path) -> torch.dtype:
    """The dtype a checkpoint holds its weights in: a model directory's `dtype` (or older
    `torch_dtype`) in config.json; float32 for a training run's checkpoint (its master weights)."""
    if not is_hf_directory(checkpoint):
        return torch.float32
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(str(name), torch.float32)


def serving_dtype(requested: DtypeName, use_gpu: bool, checkpoint: str | Path) -> torch.dtype:
    """What `requested` means for a model served from `checkpoint` on a GPU or a CPU."""
    if requested != "auto":
        return DTYPES[requested]
    if not use_gpu:
        return torch.float32
    return torch.float16 if stored_dtype(checkpoint) == torch.float16 else torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def native_bfloat16_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool | None:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX), as Linux lists its
    flags; None where it does not say (another system)."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


def described(dtype: torch.dtype, use_gpu: bool) -> str:
    """The dtype as a replica's log names it, with a warning where it is the slow choice."""
    if dtype == torch.bfloat16 and not use_gpu and native_bfloat16_cpu() is False:
        return ("bfloat16 (emulated on this CPU, which has neither AVX-512 BF16 nor AMX: dtype float32 "
                "decodes faster here)")
    return dtype_name(dtype)


def cast_for_serving(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model`'s floating-point parameters and stored buffers in `dtype`, in place (ties kept: `to`
    converts each tensor once). Buffers no checkpoint holds (rotary frequencies) keep their own
    dtype: transformers computes positions from them in float32, and so do the reference engines.
    Called on a model built on the meta device, before it has storage, the weights are then
    allocated and read in `dtype` directly: a bfloat16 replica never holds a float32 copy."""
    kept = {(module, name): buffer.dtype for module in model.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None and name in module._non_persistent_buffers_set}
    model.to(dtype)
    for (module, name), original in kept.items():
        module._buffers[name] = module._buffers[name].to(original)
    return model
