"""The user's own module: `model.factory` names a function that takes the model section and
returns an `nn.Module` mapping token ids (B, T) to logits (B, T, vocab_size).

Data parallelism and sharding (DDP, FSDP, ZeRO, local SGD) work for any such module. FSDP wraps
each block the module names the way transformers does, in `_no_split_modules` (class names), and
shards the rest at the root.
"""

from __future__ import annotations

import importlib

from torch import nn

from shardyard.spec import CustomSpec


def build_custom(spec: CustomSpec) -> nn.Module:
    module, _, function = spec.factory.partition(":")
    model = getattr(importlib.import_module(module), function)(spec)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model.factory '{spec.factory}' returned {type(model).__name__}, not an nn.Module")
    return model
