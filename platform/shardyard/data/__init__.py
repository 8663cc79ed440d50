"""Datasets built from the `data` section of a job spec, and the resumable global sampler."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from shardyard.data.corpus import corpus_windows
from shardyard.data.sampler import GlobalSampleOrder, SequentialOrder, micro_batch_ids
from shardyard.data.shards import open_split, validation_source
from shardyard.data.synthetic import SyntheticRegression, SyntheticTokens
from shardyard.data.user_dataset import UserStream, user_dataset
from shardyard.spec import LANGUAGE_MODELS, JobSpec


class Dataset(Protocol):
    def __len__(self) -> int: ...

    def batch(self, ids: torch.Tensor) -> tuple[Any, Any]:
        """(the model's input, what the loss reads with its output): tensors (inputs, targets) for
        the built-in data, the user's own batch for data.factory (data/user_dataset.py)."""


def build_dataset(spec: JobSpec) -> Dataset | UserStream:
    model, data = spec.model, spec.data
    if data.name == "corpus":
        tokenizer = None
        if getattr(model, "brings_tokenizer", False):
            from shardyard.models.hf import load_tokenizer  # imports transformers: only when asked for

            tokenizer = load_tokenizer(model)
        return corpus_windows(data.path, model.block_size, data.max_bytes, tokenizer)
    if data.name == "shards":
        return open_split(data.path, "train", model.block_size, data.cache_dir, data.cache_bytes)
    if data.name == "factory":
        return user_dataset(data)
    if isinstance(model, LANGUAGE_MODELS):
        return SyntheticTokens(data.num_samples, model.block_size, model.vocab_size, spec.run.seed)
    return SyntheticRegression(data.num_samples, model.in_dim, model.out_dim, spec.run.seed)


def build_validation(spec: JobSpec) -> Dataset | UserStream | None:
    """The validation samples (`eval.every_n_steps`), or None when the run does not validate."""
    data = spec.data
    if spec.eval.every_n_steps is None:
        return None
    if data.name == "factory":
        return user_dataset(data, "validation")
    path, split = validation_source(data.path, data.validation_path)
    return open_split(path, split, spec.model.block_size, data.cache_dir, data.cache_bytes)


def sample_order(dataset: Dataset | UserStream, seed: int) -> GlobalSampleOrder | SequentialOrder:
    """Training's order: a map-style dataset shuffled afresh each epoch, a stream in its own order."""
    return SequentialOrder(None) if isinstance(dataset, UserStream) else GlobalSampleOrder(len(dataset), seed)


def validation_order(dataset: Dataset | UserStream) -> SequentialOrder:
    """Validation's: the first samples, the same at every evaluation."""
    return SequentialOrder(None if isinstance(dataset, UserStream) else len(dataset))


__all__ = ["Dataset", "GlobalSampleOrder", "SequentialOrder", "UserStream", "build_dataset", "build_validation",
           "micro_batch_ids", "sample_order", "validation_order"]
