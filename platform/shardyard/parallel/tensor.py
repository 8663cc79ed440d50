"""Tensor (intra-layer) parallelism: each attention and MLP linear split across the tp ranks.

Megatron-style pairs: q/k/v and fc_in are split by output features (column-wise), out_proj and
fc_out by input features (row-wise), so each block needs one all-reduce in forward per pair and
the heads and hidden units a rank owns never leave it. Embeddings, norms and the head stay
replicated (small next to the blocks).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    plan = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.out_proj": RowwiseParallel(),
        "mlp.fc_in": ColwiseParallel(),
        "mlp.fc_out": RowwiseParallel(),
    }
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, plan)
    return model
