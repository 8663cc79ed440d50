"""Tensor (intra-layer) parallelism: each attention and MLP linear split across the tp ranks.

Megatron-style pairs, as the model's plan names them (`block_tp_plan`: the GPT's own, or a
Hugging Face model's `base_model_tp_plan`): q/k/v and the MLP's input projections are split by
output features (column-wise), the attention output and the MLP's output projection by input
features (row-wise), so each block needs one all-reduce in forward per pair and the heads and
hidden units a rank owns never leave it. Embeddings, norms and the head stay replicated (small
next to the blocks).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardyard.models import repeated_blocks

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    plan = {name: STYLES[style]() for name, style in model.block_tp_plan.items()}
    for parent, name in repeated_blocks(model):
        parallelize_module(getattr(parent, name), tp_mesh, plan)
    return model
