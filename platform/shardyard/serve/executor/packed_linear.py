"""Linear layers served on a CPU, with their weights laid out once for oneDNN's matrix product.

A served model's weights never change between swaps (a swap loads a whole new model), so each
linear weight can be reordered once into the blocked layout oneDNN multiplies fastest, as vLLM's
CPU backend does (its `onednn_mm` over a prepacked weight), instead of `F.linear` handing the
plain weight to the BLAS on every call. On this project's 2-core AMD EPYC machine the BLAS (MKL)
ran a 16-row decode's products at about 6 GB/s of weights read, a third of what memory gives; the
packed product took half the time or less from 1 to 128 rows, and three quarters at 1,024 (a
prompt's pass). A 16-row decode pass of benchmarks/serve_vs_vllm.py's Llama went from 40 to
29 ms; its `shardyard-in-process-plain-linears` rows measure the engine without packing.

The packed copy is held beside the plain weight, which stays the parameter: state, finiteness
checks, parameter counts and tied embeddings read it as before. So a CPU-served model's linear
weights take twice their memory; `SHARDYARD_PACKED_LINEAR=0` turns packing off.

The reorder and the product are PyTorch's own oneDNN operators, the ones its compiler emits for a
frozen CPU graph (`torch.ops.mkldnn`); where they are missing, a linear stays as it was.
"""

from __future__ import annotations

import os

import torch
from torch import nn

ENV = "SHARDYARD_PACKED_LINEAR"
ROWS_HINT = 128  # the row count the layout is chosen for; any row count multiplies correctly


def packing_available() -> bool:
    """oneDNN is built in and its linear operators are there, and packing is not turned off."""
    return (os.environ.get(ENV, "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Linear):
    """`linear`, same parameters (the same objects: tied weights stay tied), multiplied through a
    copy of its weight in oneDNN's layout."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packable(module: nn.Module) -> bool:
    """A plain linear whose weight is an ordinary CPU tensor of a dtype oneDNN multiplies (not a
    tensor-parallel slice, which is a DTensor, nor a GPU's)."""
    return (type(module) is nn.Linear and type(module.weight.data) is torch.Tensor
            and module.weight.device.type == "cpu" and module.weight.dtype in (torch.float32, torch.bfloat16))


def pack_linears(model: nn.Module) -> nn.Module:
    """`model` with every packable linear packed, in place (for inference: the packed copy does
    not follow later changes to the weight)."""
    if not packing_available():
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if packable(child):
                try:
                    setattr(parent, name, PackedLinear(child))
                except RuntimeError:  # oneDNN cannot lay this weight out (its dtype on this CPU): stays plain
                    continue
    return model
