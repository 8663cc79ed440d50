"""A dataset of the user's own (`data.name: factory`): any map-style dataset, its samples of any
type collated into batches by the user's function or torch's default_collate. The global sample
order, the ledger and resumption at any world size work on its indices as on every dataset's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from shardyard.spec import DataSpec
from shardyard.spec.factories import load_factory


class UserDataset:
    def __init__(self, samples: Any, collate: Callable[[list[Any]], Any] = default_collate) -> None:
        if not (hasattr(samples, "__len__") and hasattr(samples, "__getitem__")):
            raise TypeError(f"data.factory returned {type(samples).__name__}, not a map-style dataset "
                            f"(it needs len() and [index])")
        self.samples, self.collate = samples, collate

    def __len__(self) -> int:
        return len(self.samples)

    def batch(self, ids: torch.Tensor) -> tuple[Any, Any]:
        """(what the model is called on, the whole batch, which the loss reads)."""
        batch = self.collate([self.samples[int(i)] for i in ids])
        return model_input(batch), batch


def model_input(batch: Any) -> Any:
    """The model's argument: a tuple or list batch's first element (inputs, targets, ...), else the batch."""
    return batch[0] if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) else batch


def user_dataset(data: DataSpec, split: str = "train") -> UserDataset:
    """The training split: data.factory(**data.options); the validation split: data.factory called
    with data.validation_options over them."""
    options = data.options if split == "train" else {**data.options, **(data.validation_options or {})}
    samples = load_factory(data.factory)(**options)
    return UserDataset(samples, load_factory(data.collate) if data.collate else default_collate)
