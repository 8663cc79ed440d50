"""Random initial weights drawn one unit at a time, so that no rank ever holds the whole model.

A unit is one repeated block (a decoder layer, with everything under it: some models' init scales
a block's projections from the block itself), or one other module with weights of its own (an
embedding, the final norm, the head). Each unit is drawn whole, on the CPU, from its own seed: the
run's seed and the unit's name. So its values do not depend on which other units a rank holds
or in which order it draws them: one process drawing every unit, a rank keeping its FSDP or
tensor-parallel slices of every unit, a pipeline stage drawing only its own layers, and ZeRO-3's
rank 0 filling one gathered unit after another all start from the same weights. The largest
temporary is one unit, never the model.

How a unit is drawn is the model's own: torch's defaults first (`reset_parameters`, as building
the module would run), then the model's `reset_weights(module)` (GPT-2's scaled residual init,
transformers' `_init_weights`).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardyard.layout.blocks import repeated_blocks


class InitialWeights(Protocol):
    """Weights a model starts from instead of drawn ones: a model directory's, which the
    checkpoint side reads (checkpoint/pretrained.py). Names are the model's."""

    def fill(self, part: nn.Module) -> None:
        """Fill `part` (given storage; perhaps sharded or split off) with its tensors or slices."""

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, whole."""


def draw_seed() -> int:
    """The seed a model's units derive theirs from, drawn from the caller's generator: ranks
    seeded alike draw alike, as they would draw alike weights."""
    return int(torch.randint(0, 2**62, (), device="cpu").item())


def unit_seed(seed: int, name: str) -> int:
    # Python's own hash of a string changes from process to process; this one does not.
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def units(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, is_block) of each unit, in the model's order."""
    blocks = {id(getattr(parent, name)) for parent, name in repeated_blocks(model)}
    found: list[tuple[str, nn.Module, bool]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if id(module) in blocks:
            found.append((prefix, module, True))
            return
        if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)):
            found.append((prefix, module, False))
        for name, child in module.named_children():
            if child is not None:
                visit(f"{prefix}.{name}" if prefix else name, child)

    visit("", model)
    return found


def _own(module: nn.Module, prefix: str, is_block: bool) -> list[tuple[str, torch.Tensor]]:
    """A unit's parameters and buffers by their names in the model (a block's whole subtree; for
    any other unit, its own tensors only: its children are units of their own)."""
    dot = f"{prefix}." if prefix else ""
    return ([(dot + n, p) for n, p in module.named_parameters(recurse=is_block, remove_duplicate=False)]
            + [(dot + n, b) for n, b in module.named_buffers(recurse=is_block, remove_duplicate=False)])


def _draw(shapes: nn.Module, module: nn.Module, is_block: bool, seed: int) -> nn.Module:
    """A full-size copy of one unit on the CPU, initialised as the model initialises it."""
    unit = copy.deepcopy(module)
    if not is_block:
        for name, _ in list(unit.named_children()):
            setattr(unit, name, None)
    unit.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for sub in unit.modules():
            if callable(getattr(sub, "reset_parameters", None)):
                sub.reset_parameters()
        shapes.reset_weights(unit)
    return unit


def initial_values(shapes: nn.Module, wanted: set[str] | None = None,
                   weights: InitialWeights | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The model's initial tensors, one unit's full-size tensors at a time, by name: `weights`',
    or drawn. `shapes`: the model, unsharded, on the meta device (drawing needs its structure
    only). A weight tied under several names is given once, under its first. `wanted`: the names
    a caller holds (units with none of them are not drawn: a pipeline stage's other layers)."""
    seen: set[int] = set()
    for prefix, module, is_block in units(shapes):
        own = [(n, t) for n, t in _own(module, prefix, is_block) if wanted is None or n in wanted]
        fresh = [n for n, t in own if id(t) not in seen]
        seen.update(id(t) for _, t in own)
        if not fresh:
            continue
        if weights is not None:
            yield {n: weights.tensor(n) for n in fresh}
            continue
        drawn = dict(_own(_draw(shapes, module, is_block, unit_seed(shapes.init_seed, prefix)), prefix, is_block))
        yield {n: drawn[n] for n in fresh}


@torch.no_grad()
def copy_local(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy into `target` its part of `whole`: all of it, or, for a sharded tensor (FSDP, tensor
    parallelism), this rank's slice, cut locally without any communication."""
    if isinstance(target, DTensor):
        whole = distribute_tensor(whole.detach().to(target.device), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target = target.to_local()
    target.copy_(whole)


def fill_local(part: nn.Module, shapes: nn.Module) -> None:
    """Give `part` (built on the meta device, then sharded or split, then given storage) its
    initial weights: each rank copies its own slices of each unit `shapes` draws. Names are the
    state dict's, which activation checkpointing's wrapper leaves alone. (Non-persistent buffers,
    such as rotary frequencies, are the model's `compute_buffers`.)"""
    targets = part.state_dict(keep_vars=True)
    for values in initial_values(shapes, wanted=set(targets)):
        for name, value in values.items():
            copy_local(targets[name], value)
