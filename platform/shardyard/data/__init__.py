"""Datasets built from the `data` section of a job spec, and the resumable global sampler."""

from __future__ import annotations

from typing import Protocol

import torch

from shardyard.data.corpus import TextCorpus
from shardyard.data.sampler import GlobalSampleOrder, micro_batch_ids
from shardyard.data.synthetic import SyntheticRegression, SyntheticTokens
from shardyard.spec import LANGUAGE_MODELS, JobSpec


class Dataset(Protocol):
    def __len__(self) -> int: ...

    def batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def build_dataset(spec: JobSpec) -> Dataset:
    model, data = spec.model, spec.data
    if data.name == "corpus":
        tokenizer = None
        if getattr(model, "brings_tokenizer", False):
            from shardyard.models.hf import load_tokenizer  # imports transformers: only when asked for

            tokenizer = load_tokenizer(model)
        return TextCorpus.from_path(data.path, model.block_size, data.max_bytes, tokenizer)
    if isinstance(model, LANGUAGE_MODELS):
        return SyntheticTokens(data.num_samples, model.block_size, model.vocab_size, spec.run.seed)
    return SyntheticRegression(data.num_samples, model.in_dim, model.out_dim, spec.run.seed)


__all__ = ["Dataset", "GlobalSampleOrder", "build_dataset", "micro_batch_ids"]
