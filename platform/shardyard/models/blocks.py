"""The repeated blocks of a model: what FSDP wraps one by one, activation checkpointing
recomputes, and random initialisation draws one at a time."""

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
