"""Models built from the `model` section of a job spec: the reference GPT and MLP, Hugging Face
causal LMs (hf.py) and the user's own modules (custom.py). The engines see one interface: a
module's forward maps inputs to outputs the spec's loss reads, and `repeated_blocks` names the
blocks to wrap one by one."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardyard.models.gpt import GPT, lm_loss
from shardyard.models.mlp import MLP, mse_loss
from shardyard.spec import CustomSpec, GPTSpec, HFSpec, JobSpec, MLPSpec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_model(spec: GPTSpec | MLPSpec | HFSpec | CustomSpec, pretrained: bool = True) -> nn.Module:
    """`pretrained=False` skips reading a Hugging Face directory's weights (shapes only)."""
    if isinstance(spec, GPTSpec):
        return GPT(spec)
    if isinstance(spec, MLPSpec):
        return MLP(spec)
    if isinstance(spec, HFSpec):
        from shardyard.models.hf import HFCausalLM  # imports transformers: only when asked for

        return HFCausalLM(spec, pretrained)
    from shardyard.models.custom import build_custom

    return build_custom(spec)


def build_for_job(spec: JobSpec) -> nn.Module:
    """The model a job trains. A Hugging Face model directory under a strategy that splits the
    model (FSDP, tensor parallelism, pipeline stages, and their combinations; ZeRO-3) is built on
    the meta device, with no weights: the engine shards or splits it, then each rank reads only
    its part of the directory's weights (`materialise`; ZeRO-3 rebuilds it partitioned and fills
    one parameter at a time), so a model larger than one rank's memory never materialises whole.
    Everything else is built whole, from the same seed on every rank (DDP and ZeRO-1/2 hold the
    whole model on every rank anyway)."""
    model, par = spec.model, spec.parallelism
    splits = par.pp > 1 or par.strategy in ("fsdp", "tensor", "zero3")
    if isinstance(model, HFSpec) and model.path is not None and splits and spec.scaling.recovery != "hot":
        with torch.device("meta"):
            return build_model(model, pretrained=False)
    return build_model(model)


def materialise(part: nn.Module, device: torch.device) -> nn.Module:
    """Storage on `device` for a part built on the meta device (build_for_job) once it is sharded
    or split off, then its weights: each rank reads only the tensors (or slices) it holds."""
    part.to_empty(device=device)
    part.load_pretrained_in_place()
    return part


def loss_fn_for(spec: GPTSpec | MLPSpec | HFSpec | CustomSpec) -> LossFn:
    return mse_loss if isinstance(spec, MLPSpec) else lm_loss


def repeated_blocks(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute name) of each block whose class the model names in `_no_split_modules`
    (the transformers convention, which the reference models follow too), outermost first."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    found: list[tuple[nn.Module, str]] = []

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if type(child).__name__ in classes:
                found.append((parent, name))
            else:
                visit(child)

    visit(model)
    return found


__all__ = ["GPT", "MLP", "LossFn", "build_for_job", "build_model", "loss_fn_for", "repeated_blocks"]
