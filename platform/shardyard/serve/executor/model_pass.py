"""One forward pass of a served language model, wherever it runs (the replica's own process:
serve/executor/local_model.py; a shard actor: serve/executor/shard_actors.py): the model on its tokens as the pass's
`extra` says (left padding of ragged prompts, or a step of KV-cached decoding), and what leaves it
(each row's pick, where the logits are, or the logits themselves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardyard.models.kv_cache import KVCache
from shardyard.models.kv_layout import CacheStep
from shardyard.serve.sampling import Draw, Outcome, choose_rows
from shardyard.spec import CustomSpec, GPTSpec, HFSpec

# A forward pass's second argument: left padding per row (a batch of ragged prompts, no cache),
# or a step of KV-cached decoding.
Extra = torch.Tensor | CacheStep | None


@dataclass
class PassTimes:
    """Seconds a model's passes spent, summed, where the model runs (its thread or process): the
    model's own computation (of which `attention_s` attends over the KV cache, eager passes on a
    CPU only) and choosing each row's token from the logits (`sampling_s`; on a GPU it also waits
    for the pass's kernels, which run asynchronously)."""
    passes: int = 0
    model_s: float = 0.0
    attention_s: float = 0.0
    sampling_s: float = 0.0


def run_model(model: torch.nn.Module, x: torch.Tensor, extra: Extra, cache: KVCache | None) -> torch.Tensor:
    """`model` on `x`, as `extra` says: left padding, or a step of KV-cached decoding."""
    if not isinstance(extra, CacheStep):
        return model(x, extra)
    if extra.reset:
        return x
    cache.begin(extra, x.shape[1], x.device)
    return model(x, cache=cache)


Draws = Sequence[Draw | None] | None


def model_output(logits: torch.Tensor, extra: Extra, draws: Draws) -> torch.Tensor | list[Outcome]:
    """What leaves the model: with draws, each row's pick from its last position's logits (token
    ids, not logits); without, the logits, of each sequence's last position only for a cached step
    (its caller reads only the next token's, so a prefill's others need not travel)."""
    if isinstance(extra, CacheStep):
        last = logits[:, -1]  # (sequences, vocabulary): a cached pass's logits are its sequences' last
        return choose_rows(last, draws) if draws is not None else last[:, None].cpu()
    if draws is not None:
        return choose_rows(logits[:, -1, :], draws)
    return logits.cpu()


def supports_kv_cache(spec: GPTSpec | HFSpec | CustomSpec) -> bool:
    """Whether the engine can decode this model with its KV cache (models/kv_cache.py): the own GPT,
    and a Hugging Face model whose every layer attends over the whole served context (full
    attention, or a sliding window at least as long as the context); the cache holds every past
    token, which a narrower window would not read. Other models (custom modules, windows
    narrower than the context, linear-attention or state-space layers) are served by static
    batching, recomputing the sequence every token."""
    if isinstance(spec, GPTSpec):
        return True
    if not isinstance(spec, HFSpec):
        return False
    config = spec.hf_config()
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return False
    return "sliding_attention" not in kinds or window is None or window >= spec.block_size


def all_finite(module: torch.nn.Module) -> bool:
    """No NaN or infinity in any weight (a tensor-parallel rank checks its own slices)."""
    return all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
               for p in module.parameters())
