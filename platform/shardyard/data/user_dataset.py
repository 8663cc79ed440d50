"""A dataset of the user's own (`data.name: factory`): any map-style dataset, or an iterable one
(a stream), its samples of any type collated into batches by the user's function or torch's
default_collate. The global sample order, the ledger and resumption at any world size work on a
map-style dataset's indices as on every dataset's, and on a stream's positions."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from shardyard.spec import DataSpec
from shardyard.spec.factories import load_factory


class UserDataset:
    def __init__(self, samples: Any, collate: Callable[[list[Any]], Any] = default_collate) -> None:
        if not (hasattr(samples, "__len__") and hasattr(samples, "__getitem__")):
            raise TypeError(f"data.factory returned {type(samples).__name__}, neither a map-style dataset "
                            f"(len() and [index]) nor an iterable one")
        self.samples, self.collate = samples, collate

    def __len__(self) -> int:
        return len(self.samples)

    def batch(self, ids: torch.Tensor) -> tuple[Any, Any]:
        """(what the model is called on, the whole batch, which the loss reads)."""
        batch = self.collate([self.samples[int(i)] for i in ids])
        return model_input(batch), batch

    def first_batch(self) -> tuple[Any, Any]:
        """The first sample as a batch of one (what FLOPs are counted on)."""
        return self.batch(torch.tensor([0]))


class UserStream:
    """An iterable dataset of the user's own, read in its own order and started again from its
    beginning when it ends (a new pass): sample ids are positions in that endless sequence. Every
    rank reads the stream and keeps the positions the global order deals it, so a run resumed at
    any world size goes on at the exact position its progress names. Resuming opens a fresh
    stream at that position: with its `skip(n)` where it has one (a stream starting n samples
    later, as Hugging Face datasets' IterableDataset gives), else by reading past n samples."""

    def __init__(self, make: Callable[[], Iterable[Any]], collate: Callable[[list[Any]], Any] = default_collate) -> None:
        self.make, self.collate = make, collate
        self.length: int | None = None  # samples in one pass, known once a pass has ended
        self._iterator: Iterator[Any] = iter(())
        self._next: int | None = None  # the position the iterator yields next; None: not open
        self._pass_start = 0  # the position the current pass began at
        self._skipped = False  # opened with skip() and nothing read since: the pass's length is unknown

    def batch(self, ids: torch.Tensor) -> tuple[Any, Any]:
        """(what the model is called on, the whole batch, which the loss reads)."""
        batch = self.collate([self._sample_at(int(i)) for i in ids])
        return model_input(batch), batch

    def first_batch(self) -> tuple[Any, Any]:
        """The first sample as a batch of one (what FLOPs are counted on), read from a stream of its
        own: the training stream stays unopened, so that a resumed run opens it where it resumes
        (with skip() where the stream has one) rather than reading on from the first sample."""
        return UserStream(self.make, self.collate).batch(torch.tensor([0]))

    def _sample_at(self, position: int) -> Any:
        if self._next is None or position < self._next:  # behind (a resumed run, each validation)
            self._open(position)
        while True:
            if self.length is not None and position - self._next >= self.length:
                self._open(position)  # passes ahead: start a fresh one where it lies
            at, sample = self._take()
            if at == position:
                return sample

    def _open(self, position: int) -> None:
        """A fresh stream whose next sample is `position`'s, or one of the pass it lies in."""
        offset = position if self.length is None else position % self.length
        stream = self.make()
        self._skipped = offset > 0 and hasattr(stream, "skip")
        self._iterator = iter(stream.skip(offset) if self._skipped else stream)
        self._pass_start = position - offset
        self._next = position if self._skipped else self._pass_start

    def _take(self) -> tuple[int, Any]:
        """(position, sample) of the stream's next sample, a new pass begun where one ends."""
        while True:
            try:
                sample = next(self._iterator)
            except StopIteration:
                if self._skipped:  # skipped past the pass's end, whose length is not known: read it
                    self._iterator, self._next, self._skipped = iter(self.make()), self._pass_start, False
                    continue
                if self._next == self._pass_start:
                    raise ValueError("data.factory's iterable dataset yielded no samples") from None
                self.length = self._next - self._pass_start
                self._iterator, self._pass_start = iter(self.make()), self._next
                continue
            self._skipped = False
            self._next += 1
            return self._next - 1, sample


def model_input(batch: Any) -> Any:
    """The model's argument: a tuple or list batch's first element (inputs, targets, ...), else the batch."""
    return batch[0] if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)) else batch


def user_dataset(data: DataSpec, split: str = "train") -> UserDataset | UserStream:
    """The training split: data.factory(**data.options); the validation split: data.factory called
    with data.validation_options over them. A stream is made again for each pass."""
    options = data.options if split == "train" else {**data.options, **(data.validation_options or {})}
    factory, collate = load_factory(data.factory), load_factory(data.collate) if data.collate else default_collate
    samples = factory(**options)
    if is_stream(samples):
        return UserStream(lambda: factory(**options), collate)
    return UserDataset(samples, collate)


def is_stream(samples: Any) -> bool:
    """An iterable dataset: torch's IterableDataset (whose base class has a [] that raises), or any
    iterable without [index] (a generator)."""
    return isinstance(samples, IterableDataset) or (hasattr(samples, "__iter__") and not hasattr(samples, "__getitem__"))
