"""Models built from the `model` section of a job spec: the reference GPT and MLP, Hugging Face
causal LMs (hf.py) and the user's own modules (custom.py: language models, or any module for a
task of the user's own). The engines see one interface: a
module's forward maps inputs to outputs the spec's loss reads, and `repeated_blocks` names the
blocks to wrap one by one."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardyard.layout.blocks import names_of_each_parameter, repeated_blocks
from shardyard.models.gpt import GPT, lm_loss
from shardyard.models.initial_weights import InitialWeights, draw_seed, fill_local
from shardyard.models.mlp import MLP, mse_loss
from shardyard.spec import CustomSpec, GPTSpec, HFSpec, JobSpec, MLPSpec, ModuleSpec
from shardyard.spec.factories import load_factory

LossFn = Callable[[Any, Any], torch.Tensor]  # (the model's output, the targets or the user's whole batch)
# (the model's output, a validation batch) -> {name: the mean over the batch's samples}
MetricsFn = Callable[[Any, Any], Mapping[str, Any]]


def build_model(spec: GPTSpec | MLPSpec | HFSpec | CustomSpec | ModuleSpec,
                weights: InitialWeights | None = None) -> nn.Module:
    """The model, whole, on the caller's default device (under `torch.device("meta")`: shapes
    only), with `weights` (a model directory's: checkpoint/pretrained.py) or, without, drawn at
    random one unit at a time (initial_weights.py), as every strategy that shards it draws it."""
    if isinstance(spec, MLPSpec):
        return MLP(spec)
    if isinstance(spec, (CustomSpec, ModuleSpec)):
        from shardyard.models.custom import build_custom

        return build_custom(spec)
    device = torch.get_default_device()
    with torch.device("meta"):
        model = new_model(spec)
    return model if device.type == "meta" else materialise(model, device, weights=weights)


def new_model(spec: GPTSpec | HFSpec) -> nn.Module:
    """The GPT or a Hugging Face model as its constructor builds it, on the caller's device (or
    under DeepSpeed's `zero.Init`); `init_seed` (the seed its units are drawn from) is drawn from
    the caller's generator, so ranks seeded alike build alike."""
    if isinstance(spec, GPTSpec):
        model: nn.Module = GPT(spec)
    else:
        from shardyard.models.hf import HFCausalLM  # imports transformers: only when asked for

        model = HFCausalLM(spec)
    model.init_seed = draw_seed()
    return model


def build_for_job(spec: JobSpec, weights: InitialWeights | None = None) -> nn.Module:
    """The model a job trains. Under a strategy that splits the model (FSDP, tensor parallelism,
    pipeline stages, and their combinations; ZeRO-3) the GPT and Hugging Face models are built on
    the meta device, with no weights: the engine shards or splits them, then each rank gives its
    part storage and fills it (`materialise`: its slices of the model directory's weights, or of
    each unit drawn at random; ZeRO-3 rebuilds the model partitioned and fills one gathered unit
    at a time), so a model larger than one rank's memory never materialises whole. Everything
    else is built whole, from the same seed on every rank (DDP and ZeRO-1/2 hold the whole model
    on every rank anyway; a custom module's initialisation is its factory's own). `weights`: a
    model directory's (checkpoint/pretrained.py), for a model built whole here; the engine fills
    a split one with them (parallel.build_engine)."""
    model, par = spec.model, spec.parallelism
    splits = par.pp > 1 or par.strategy in ("fsdp", "tensor", "zero3")
    if isinstance(model, (GPTSpec, HFSpec)) and splits and spec.scaling.recovery != "hot":
        with torch.device("meta"):
            return build_model(model)
    return build_model(model, weights)


def materialise(part: nn.Module, device: torch.device, shapes: nn.Module | None = None,
                weights: InitialWeights | None = None) -> nn.Module:
    """Storage on `device` for a part built on the meta device (build_for_job) once it is sharded
    or split off, then its weights: each rank reads (from `weights`) or draws only the tensors (or
    slices) it holds. `shapes`: the model as it was before sharding, on the meta device (for a part
    that is not sharded, the part itself), to draw from."""
    shapes = copy.deepcopy(part) if shapes is None and weights is None else shapes
    give_storage(part, device)
    if weights is not None:
        weights.fill(part)
    else:
        fill_local(part, shapes)
    return part


def give_storage(part: nn.Module, device: torch.device) -> None:
    """Uninitialised storage on `device` for a part built on the meta device, its ties kept, and
    its non-persistent buffers (rotary frequencies: in no file or checkpoint) computed; the
    weights are the caller's to fill."""
    _to_empty_keeping_ties(part, device)
    if callable(getattr(part, "compute_buffers", None)):
        part.compute_buffers()


def _to_empty_keeping_ties(part: nn.Module, device: torch.device) -> None:
    """`to_empty`, then a weight tied under several names (a head tied to its embedding) made one
    tensor again: `to_empty` gives a meta parameter a new tensor under each name it has."""
    tied = [names for names in names_of_each_parameter(part) if len(names) > 1]
    part.to_empty(device=device)
    for first, *others in tied:
        for name in others:
            parent, _, leaf = name.rpartition(".")
            setattr(part.get_submodule(parent), leaf, part.get_parameter(first))


def loss_fn_for(spec: JobSpec) -> LossFn:
    """The job's loss: the user's own (`loss.factory`, for model.name 'module'), the MLP's mean
    squared error, or a language model's next-token cross-entropy."""
    if spec.loss is not None:
        return load_factory(spec.loss.factory)(**spec.loss.options)
    return mse_loss if isinstance(spec.model, MLPSpec) else lm_loss


def metrics_fn_for(spec: JobSpec) -> MetricsFn | None:
    """The validation metrics of a task of the user's own (`metrics.factory`), if it names them."""
    return None if spec.metrics is None else load_factory(spec.metrics.factory)(**spec.metrics.options)


__all__ = ["GPT", "MLP", "LossFn", "MetricsFn", "build_for_job", "build_model", "give_storage", "loss_fn_for",
           "materialise", "metrics_fn_for", "new_model", "repeated_blocks"]
