"""A small decoder-only GPT that reads in one sitting.

Written for the parallel strategies to take apart:
- blocks live in an `nn.ModuleDict` keyed "0".."n-1", so a pipeline stage can delete the blocks
  it does not own and every remaining parameter keeps its fully-qualified name (checkpoints from
  any strategy then share one set of keys);
- `forward` skips any part set to None (embeddings on later stages, the head on earlier ones);
- attention uses separate q/k/v/out projections and infers the head count from the projection
  width, so tensor parallelism can shard heads column-wise without touching this code.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from shardyard.models.kv_cache import KVCache
from shardyard.models.stages import PipelineLayout
from shardyard.spec import GPTSpec


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.head_dim = spec.n_embd // spec.n_head
        self.q_proj = nn.Linear(spec.n_embd, spec.n_embd)
        # No key bias: it adds the same q.b to every score in a row, which softmax ignores, so
        # its gradient is exactly zero and Adam would only amplify rounding noise into it.
        self.k_proj = nn.Linear(spec.n_embd, spec.n_embd, bias=False)
        self.v_proj = nn.Linear(spec.n_embd, spec.n_embd)
        self.out_proj = nn.Linear(spec.n_embd, spec.n_embd)
        self.dropout = spec.dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, layer: str = "") -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q, k, v = (
            proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        if cache is not None:  # decoding: attend over the cached past too
            y = cache.attend(layer, q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0
            )
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.fc_in = nn.Linear(spec.n_embd, 4 * spec.n_embd)
        self.fc_out = nn.Linear(4 * spec.n_embd, spec.n_embd)
        self.dropout = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(F.gelu(self.fc_in(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.n_embd)
        self.attn = CausalSelfAttention(spec)
        self.ln_2 = nn.LayerNorm(spec.n_embd)
        self.mlp = FeedForward(spec)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, layer: str = "") -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    # Blocks FSDP wraps one by one and activation checkpointing recomputes (transformers' name).
    _no_split_modules = ("Block",)
    # How tensor parallelism splits each block (parallel/tensor.py): Megatron's column/row pairs.
    block_tp_plan = {"attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
                     "attn.out_proj": "rowwise", "mlp.fc_in": "colwise", "mlp.fc_out": "rowwise"}
    # Every layer's attention over the serving engine's KV cache is the cache's own (`attend`), so
    # the engine may pack prompt chunks and decode steps into one pass.
    cache_attends = True

    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_emb: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.n_embd)
        self.pos_emb: nn.Embedding | None = nn.Embedding(spec.block_size, spec.n_embd)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(spec) for i in range(spec.n_layer)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(spec.n_embd)
        self.lm_head: nn.Linear | None = nn.Linear(spec.n_embd, spec.vocab_size, bias=False)
        if spec.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_weights(self)

    def reset_weights(self, module: nn.Module) -> None:
        """Initialise `module` (this model, or a part of it whole) as GPT-2 does."""
        module.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps activations stable with depth.
        for name, param in module.named_parameters():
            if name.endswith(("out_proj.weight", "fc_out.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.spec.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def pipeline_layout(self) -> PipelineLayout:
        return PipelineLayout(first=[self.tok_emb, self.pos_emb], blocks=list(self.blocks.values()),
                              last=[self.ln_f, self.lm_head])

    def pipeline_stage(self, start: int, end: int) -> GPT:
        """A copy holding blocks [start, end) and, on the ends, the embeddings or the head."""
        stage = copy.deepcopy(self)
        for name in [k for k in stage.blocks if not start <= int(k) < end]:
            del stage.blocks[name]
        if start > 0:
            stage.tok_emb = stage.pos_emb = None
        if end < len(self.blocks):
            stage.ln_f = stage.lm_head = None
        return stage

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); on a pipeline stage, hidden states in or out.

        `pad` (B,) counts the left-padding tokens of each row of a batch of ragged prompts: those
        positions are masked out and each row's positions start at its first real token, so a
        row's outputs equal those of the same prompt run alone.
        `cache`: decoding with a KV cache (its current step says which rows and positions); the
        caller begins and ends the step, once for all of a shard's blocks. The logits are then each
        sequence's last position's only, (sequences, 1, V).
        """
        mask = None if pad is None or cache is not None else padding_mask(pad, x.shape[1])  # a cache masks its own
        if self.tok_emb is not None:
            if cache is not None:
                positions = cache.positions(x.shape[1], x.device)
            else:
                positions = torch.arange(x.shape[1], device=x.device)
                if pad is not None:
                    positions = (positions - pad[:, None]).clamp(min=0)
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for name, block in self.blocks.items():
            x = block(x, mask, cache, name)
        if cache is not None and self.lm_head is not None:  # decoding: only each sequence's next token
            x = cache.last_tokens(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:
            x = self.lm_head(x)
        return x


def padding_mask(pad: torch.Tensor, seq: int) -> torch.Tensor:
    """(B, 1, T, T) boolean attention mask: causal, and blind to each row's left padding. A padding
    position attends to itself only (its output is never read), so no softmax row is empty."""
    index = torch.arange(seq, device=pad.device)
    causal = index[None, :] <= index[:, None]
    real_key = index[None, None, :] >= pad[:, None, None]
    own = torch.eye(seq, dtype=torch.bool, device=pad.device)
    return ((causal & real_key) | own)[:, None]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
