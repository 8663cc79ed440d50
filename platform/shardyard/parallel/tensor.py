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

Mixtures of experts keep their experts in 3-D parameters (expert, out, in), which the plan names
directly: `colwise` and `rowwise` split them by output and input features as for a linear layer,
and `packed_colwise` / `packed_rowwise` split a gate and an up projection packed in one dimension
so that each rank holds the same features of both halves (torch's strided shard: the rank's slice
of the first half, then of the second), since the expert multiplies the two elementwise. The
experts module itself (`moe_tp_experts`) then runs on the rank's slices as plain tensors: every
rank routes the same tokens to the same experts, computes its share of each expert's hidden
features, and the ranks' outputs are summed; the gradients of its inputs (hidden states, routing
weights) are summed in backward, as each rank's covers its features only.

DCP cannot write a strided shard: layout/dcp_placements.py stores such tensors as plain shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
# torch's layout for "this rank's slice of each half": the public placements have none.
from torch.distributed.tensor.placement_types import _StridedShard

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


class _SumOverRanks(torch.autograd.Function):
    """The ranks' partial outputs summed in forward; each rank's gradient passes unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumGradsOverRanks(torch.autograd.Function):
    """Identity in forward; in backward the ranks' partial gradients are summed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def experts_on_local_slices(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """`moe_tp_experts`: the module's forward sees its sharded parameters as this rank's slices
    (plain tensors, differentiable back to the DTensors), its floating-point inputs' gradients
    are summed over the ranks, and its output is the sum of the ranks' outputs."""
    group = tp_mesh.get_group()
    sharded: dict[str, nn.Parameter] = {}

    def before(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        def summed_grads(x: Any) -> Any:
            return _SumGradsOverRanks.apply(x, group) if torch.is_tensor(x) and x.is_floating_point() else x

        for name, param in module.named_parameters(recurse=False):
            if isinstance(param, DTensor):
                sharded[name] = param
                module._parameters[name] = param.to_local()
        return tuple(summed_grads(a) for a in args), {k: summed_grads(v) for k, v in kwargs.items()}

    def after(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor) -> torch.Tensor:
        module._parameters.update(sharded)
        sharded.clear()
        return _SumOverRanks.apply(output, group)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True)


# Placements of a parameter the plan names itself (an expert's 3-D weight: expert, out, in).
PARAMETER_STYLES: dict[str, Callable[[int], Placement]] = {
    "colwise": lambda ndim: Shard(ndim - 2),
    "rowwise": lambda ndim: Shard(ndim - 1),
    "packed_colwise": lambda ndim: _StridedShard(ndim - 2, split_factor=2),
    "packed_rowwise": lambda ndim: _StridedShard(ndim - 1, split_factor=2),
}


def shard_parameter(module: nn.Module, name: str, style: str, tp_mesh: DeviceMesh) -> None:
    param = module._parameters[name]
    placement = PARAMETER_STYLES[style](param.dim())
    parts = tp_mesh.size() * (2 if isinstance(placement, _StridedShard) else 1)
    if param.shape[placement.dim] % parts:
        raise ValueError(f"{style} splits dimension {placement.dim} of '{name}' {tuple(param.shape)} into "
                         f"{parts} equal parts: its size must divide by that")
    module._parameters[name] = nn.Parameter(distribute_tensor(param.detach(), tp_mesh, [placement], src_data_rank=None),
                                            requires_grad=param.requires_grad)


STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}
ROWWISE_STYLES = ("rowwise", "rowwise_split_input")


def own_output(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    """A row-wise layer's output is a view made by DTensor's `to_local`, which autograd forbids
    changing in place; a model that adds to it in place (Llama 4's shared expert output) gets a
    tensor of its own in training."""
    return output.clone() if torch.is_grad_enabled() else output


# Styles applied by a function of (module, tp mesh) rather than one of torch's ParallelStyles.
MODULE_STYLES = {"replicated_with_grad_allreduce": replicate_over_local_heads,
                 "moe_tp_experts": experts_on_local_slices}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    block_plan = model.block_tp_plan
    for parent, name in repeated_blocks(model):
        block = getattr(parent, name)
        parameters, modules = dict(block.named_parameters()), dict(block.named_modules())
        # A block need not hold every entry: Hugging Face plans name both a dense MLP and experts,
        # and a model may have either or both kinds of layer. (A custom plan is checked by its spec.)
        for entry, style in block_plan.items():
            if entry in parameters:  # an experts' 3-D weight: sharded here
                owner, _, leaf = entry.rpartition(".")
                shard_parameter(modules[owner], leaf, style, tp_mesh)
        parallelize_module(block, tp_mesh, {entry: STYLES[style]() for entry, style in block_plan.items()
                                            if style in STYLES and entry in modules})
        for entry, style in block_plan.items():
            if style in MODULE_STYLES and entry in modules:
                MODULE_STYLES[style](modules[entry], tp_mesh)
            if style in ROWWISE_STYLES and entry in modules:
                modules[entry].register_forward_hook(own_output)
    return model
