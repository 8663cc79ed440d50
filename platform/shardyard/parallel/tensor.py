"""Tensor (intra-layer) parallelism: each attention and MLP linear split across the tp ranks.

Megatron-style pairs, as the model's plan names them (`block_tp_plan`: the GPT's own, or a
Hugging Face model's `base_model_tp_plan`): q/k/v and the MLP's input projections are split by
output features (column-wise), the attention output and the MLP's output projection by input
features (row-wise), so each block needs one all-reduce in forward per pair and the heads and
hidden units a rank owns never leave it. Embeddings, norms and the head stay replicated (small
next to the blocks).

Hugging Face plans name a few more styles, each torch's own: `colwise_gather_output` and
`rowwise_split_input` (a pair whose activations between are whole on every rank: OLMo-2 normalises
q and k over all heads), and `replicated_with_grad_allreduce` (Qwen3's per-head q/k norms: whole
on every rank, applied to the rank's own heads, so each rank's gradient covers its heads only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardyard.models import repeated_blocks


def replicate_over_local_heads(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The module's weights become replicated DTensors, and its input (B, T, local heads,
    head_dim) is declared sharded by heads: DTensor's autograd then sums the ranks' gradients
    (they are partial: each rank's covers its heads) when they are used, however many
    micro-batches accumulate first, while the forward runs on local tensors as before."""

    def heads_sharded(_: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        return (DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False), *inputs[1:])

    def local(_: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local()

    distribute_module(module, tp_mesh, input_fn=heads_sharded, output_fn=local)


STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}
# Styles applied by a function of (module, tp mesh) rather than one of torch's ParallelStyles.
MODULE_STYLES = {"replicated_with_grad_allreduce": replicate_over_local_heads}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    block_plan = model.block_tp_plan
    plan = {name: STYLES[style]() for name, style in block_plan.items() if style in STYLES}
    for parent, name in repeated_blocks(model):
        block = getattr(parent, name)
        parallelize_module(block, tp_mesh, plan)
        for module_name, style in block_plan.items():
            if style in MODULE_STYLES:
                MODULE_STYLES[style](block.get_submodule(module_name), tp_mesh)
    return model
