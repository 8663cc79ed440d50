"""Choosing the next token from a model's logits: the sampling parameters OpenAI-compatible
servers take (OpenAI's own and vLLM's extensions, which load tools such as `vllm bench serve`
send), applied in vLLM's order, and the log-probabilities a client may ask for.

Order: logit bias; repetition penalty (prompt and output tokens); presence and frequency
penalties (output tokens); the end-of-sequence token held back until `min_tokens`; then greedy at
temperature 0, else temperature, top-k, min-p and top-p (nucleus) filtering and one draw from the
request's own generator. Reported log-probabilities are those of the model's raw distribution,
before any of this (vLLM's default, `raw_logprobs`): what the model thinks, not what the
sampler did with it.

A seeded request's draw for its i-th token comes from a generator seeded by (seed, i) alone, not
from a generator carried along: a `Draw` is then everything a token's choice needs, so it is made
where the logits are (the shard that computes them: only token ids leave it) and comes out the
same after a lost shard group is rebuilt and the request prefilled again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

import torch
import torch.nn.functional as F

MAX_LOGPROBS = 20  # alternatives per token a client may ask for (vLLM's default limit)
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 (or -1): every token
    min_p: float = 0.0              # drop tokens below this fraction of the likeliest one's probability
    repetition_penalty: float = 1.0  # > 1 discourages any token already in the prompt or the output
    presence_penalty: float = 0.0   # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_tokens: int = 0             # no end of sequence (nor stop string) before this many tokens
    ignore_eos: bool = False        # the end-of-sequence token does not end the completion
    logprobs: int | None = None     # None: none reported; k: the chosen token's and the k likeliest
    logit_bias: tuple[tuple[int, float], ...] = field(default=())  # (token id, bias)

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))


GREEDY = Sampling()


@dataclass(frozen=True)
class Pick:
    """The chosen token; with logprobs asked for, its log-probability and the likeliest tokens'."""
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


def adjust(logits: torch.Tensor, sampling: Sampling, prompt: Sequence[int], generated: Sequence[int],
           stop_token: int | None) -> torch.Tensor:
    """The logits after bias, penalties and `min_tokens` (a copy where anything changes)."""
    holding_eos = stop_token is not None and len(generated) < sampling.min_tokens and not sampling.ignore_eos
    if not (sampling.penalized or holding_eos):
        return logits
    out = logits.clone()
    for token, bias in sampling.logit_bias:
        out[token] += bias
    if sampling.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long)
        values = out[seen]
        out[seen] = torch.where(values > 0, values / sampling.repetition_penalty, values * sampling.repetition_penalty)
    if generated and (sampling.presence_penalty or sampling.frequency_penalty):
        ids, counts = torch.tensor(list(generated), dtype=torch.long).unique(return_counts=True)
        out[ids] -= sampling.frequency_penalty * counts.to(out.dtype) + sampling.presence_penalty
    if holding_eos:
        out[stop_token] = float("-inf")
    return out


def pick(logits: torch.Tensor, sampling: Sampling = GREEDY, generator: torch.Generator | None = None,
         prompt: Sequence[int] = (), generated: Sequence[int] = (), stop_token: int | None = None) -> Pick:
    """The next token for one sequence from its (V,) logits."""
    if torch.isnan(logits).any():
        raise RuntimeError("the model's logits hold NaN: no token can be chosen")
    adjusted = adjust(logits, sampling, prompt, generated, stop_token)
    chosen = int(sample_rows(adjusted.float()[None], [sampling], [generator])[0])
    if sampling.logprobs is None:
        return Pick(chosen)
    logprobs = F.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(min(sampling.logprobs, logprobs.numel()))
    return Pick(chosen, float(logprobs[chosen]), tuple(zip(ids.tolist(), values.tolist())))


def sample_rows(logits: torch.Tensor, samplings: Sequence[Sampling],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Each row's token id from its float (B, V) logits (adjusted already), as its sampling says:
    greedy at temperature 0, else temperature, top-k, min-p and top-p, then one draw, all rows in
    the same few operations on the logits' device. The draw inverts each row's cumulative
    distribution at one uniform number u (the first token whose running total exceeds u times the
    row's mass): one random number per row, where an exponential race or `torch.multinomial`
    draws one per token (16 rows of a 32,000-token vocabulary: 10 ms a step on this project's CPU,
    against half a millisecond). A seeded row's u comes from its own CPU generator, so a seed
    gives the same token on any device and in any batch; the unseeded rows' from one call."""
    greedy_ids = logits.argmax(-1)
    if all(s.temperature <= 0 for s in samplings):  # asked of the settings: no wait on the device
        return greedy_ids
    temperature = torch.tensor([s.temperature for s in samplings], device=logits.device)
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    vocabulary = logits.shape[-1]
    top_k = [s.top_k if 0 < s.top_k < vocabulary else vocabulary for s in samplings]
    if min(top_k) < vocabulary:
        widest = max(k for k in top_k if k < vocabulary)  # rows without a top_k are not sorted for it
        k = torch.tensor(top_k, device=logits.device)
        kth = scaled.topk(widest, dim=-1).values.gather(1, (k.clamp(max=widest) - 1)[:, None])
        scaled = scaled.masked_fill((scaled < kth) & (k < vocabulary)[:, None], float("-inf"))
    probs = F.softmax(scaled, dim=-1)
    if any(s.min_p > 0 for s in samplings):
        min_p = torch.tensor([s.min_p for s in samplings], device=logits.device)
        probs = probs.masked_fill(probs < (min_p[:, None] * probs.max(-1, keepdim=True).values), 0.0)
    if any(s.top_p < 1.0 for s in samplings):
        top_p = torch.tensor([s.top_p for s in samplings], device=logits.device)
        ordered, order = probs.sort(dim=-1, descending=True)
        # The mass before a token already reaches top_p (of what is left): it is outside.
        outside = (ordered.cumsum(-1) - ordered >= top_p[:, None] * ordered.sum(-1, keepdim=True)) & (top_p < 1)[:, None]
        probs = torch.zeros_like(probs).scatter(-1, order, ordered.masked_fill(outside, 0.0))
    uniform = torch.rand(len(samplings), 1, device=logits.device)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(1, generator=generator).to(uniform.device)
    running = probs.cumsum(-1)
    # Strictly above u x the mass: a token of probability 0 (a flat step) is never the one found.
    sampled = torch.searchsorted(running, uniform * running[:, -1:], right=True).squeeze(-1)
    # A temperature so small that the scaled logits overflow (their softmax is NaN, not a
    # distribution) is, in the limit, greedy decoding.
    greedy |= torch.isnan(running[:, -1])
    return torch.where(greedy, greedy_ids, sampled.clamp(max=vocabulary - 1))


@dataclass(frozen=True)
class Draw:
    """What choosing one sequence's next token needs besides its logits: small, so it travels to
    the shard that holds the logits instead of the logits travelling back. `prompt` and
    `generated` are carried only where penalties or `min_tokens` read them."""
    sampling: Sampling
    seed: int | None = None
    index: int = 0  # tokens the sequence has generated before this one
    stop_token: int | None = None
    prompt: tuple[int, ...] = ()
    generated: tuple[int, ...] = ()

    @property
    def logits_only(self) -> bool:
        """Its token depends on its logits alone (and its seed): no penalty, no end of sequence held
        back, nothing reported, so it is chosen in one batch with the others like it."""
        s = self.sampling
        return s.logprobs is None and not s.penalized and (s.min_tokens == 0 or s.ignore_eos)

    def generator(self) -> torch.Generator | None:
        return None if self.seed is None else torch.Generator().manual_seed(token_seed(self.seed, self.index))

    def pick(self, logits: torch.Tensor) -> Pick:
        return pick(logits, self.sampling, self.generator(), self.prompt, self.generated, self.stop_token)


def token_seed(seed: int, index: int) -> int:
    """The seed of token `index`'s draw: SplitMix64 of (seed, index), so neighbouring tokens' (and
    neighbouring seeds') generators share no stream."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


# A row's outcome: its pick, its own error (NaN logits fail that request alone), or None where no
# token was asked for (a prompt chunk that is not its last).
Outcome = Union[Pick, RuntimeError, None]


def choose_rows(logits: torch.Tensor, draws: Sequence[Draw | None]) -> list[Outcome]:
    """Each row's next token from its (V,) logits in `logits` (B, V), as its draw says. Rows that
    need only their logits (no penalties, no log-probabilities, no end of sequence held back) are
    chosen together where the logits are, and their ids cross to the host in one transfer, with
    whether each row's logits hold NaN; the others, and a NaN row (which gets its own error), one
    by one on the CPU."""
    logits = logits.float()
    together = [i for i, d in enumerate(draws) if d is not None and d.logits_only]
    out: list[Outcome] = [None] * len(draws)
    if together:
        rows = [draws[i] for i in together]
        chosen_from = logits if len(together) == len(draws) else logits[together]
        ids = sample_rows(chosen_from, [d.sampling for d in rows], [d.generator() for d in rows])
        # A NaN makes its row's sum NaN (so does +inf beside -inf: that row takes the slow way, and
        # picks there if it holds no NaN).
        picked, broken = torch.stack([ids, torch.isnan(chosen_from.sum(-1)).long()]).tolist()
        for i, token, nan in zip(together, picked, broken):
            out[i] = None if nan else Pick(token)
    for i, draw in enumerate(draws):
        if draw is None or out[i] is not None:
            continue
        try:  # on the CPU, where its penalty indices are; a NaN row raises its own error
            out[i] = draw.pick(logits[i].cpu())
        except RuntimeError as err:
            out[i] = err
    return out
