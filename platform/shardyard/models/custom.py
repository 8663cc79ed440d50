"""The user's own module. `model.name: custom`: `model.factory` takes the model section and
returns an `nn.Module` mapping token ids (B, T) to logits (B, T, vocab_size), trained as a
language model. `model.name: module`: any `nn.Module`, from `model.factory(**model.options)`, for
a task of the user's own (its data and loss are theirs too: data.factory, loss.factory).

Data parallelism and sharding (DDP, FSDP, ZeRO, local SGD) work for any such module. FSDP wraps
each block the module names the way transformers does, in `_no_split_modules` (class names), and
shards the rest at the root. Tensor and pipeline parallelism need the module to say how, with the
hooks the reference GPT has: `block_tp_plan` (parallel/tensor.py) and `pipeline_layout` with
`pipeline_stage` (models/stages.py); the spec refuses them, before any worker starts, otherwise.
"""

from __future__ import annotations

from torch import nn

from shardyard.spec import CustomSpec, ModuleSpec


def build_custom(spec: CustomSpec | ModuleSpec) -> nn.Module:
    model = spec.build()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model.factory '{spec.factory}' returned {type(model).__name__}, not an nn.Module")
    return model
