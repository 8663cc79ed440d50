"""The repeated blocks of a model (what FSDP wraps one by one, activation checkpointing
recomputes, and random initialisation draws one at a time), and the names of its parameters."""

from __future__ import annotations

from torch import nn


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


def names_of_each_parameter(model: nn.Module) -> list[list[str]]:
    """The names of each parameter, one list per tensor: a weight tied under several names (a head
    tied to its embedding) is one tensor, which files and checkpoints may keep under one name."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return list(by_tensor.values())
