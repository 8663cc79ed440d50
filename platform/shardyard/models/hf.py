"""Hugging Face causal LMs (Llama, Qwen, GPT-2, ... anything `AutoModelForCausalLM` builds) behind
the interface the engines use: token ids in, logits out, repeated blocks named by the model's own
`_no_split_modules`.

The wrapper adds one level to parameter names (`hf.`); `export_hf_directory` strips it again, so
what leaves the platform is an ordinary Hugging Face model directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardyard.spec import HFSpec

# Files a model directory may carry besides config and weights: the tokenizer travels with them.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


class HFCausalLM(nn.Module):
    def __init__(self, spec: HFSpec, pretrained: bool = True) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.spec = spec
        if spec.path is not None and pretrained:
            self.hf = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32)
        else:
            # Random init from the caller's seed, as the GPT's: every rank builds the same weights.
            # (From a directory's config alone when its weights are not wanted.)
            self.hf = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
        # Blocks FSDP wraps and activation checkpointing recomputes: the model's own decoder layers.
        self._no_split_modules = tuple(self.hf._no_split_modules or ())

    @property
    def block_tp_plan(self) -> dict[str, str]:
        """The model's own plan for tensor parallelism, per decoder layer (the spec has checked it
        fits parallelism.tp before any worker started)."""
        return self.spec.block_tp_plan(1)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V). `pad` (B,) counts each row's left padding (a
        batch of ragged prompts, as serving sends): masked out, and positions start at each row's
        first real token, so a row's logits equal its prompt's alone (as GPT.forward's)."""
        if pad is None:
            return self.hf(input_ids=x, use_cache=False).logits
        positions = torch.arange(x.shape[1], device=x.device)[None, :]
        mask = (positions >= pad[:, None]).long()
        return self.hf(input_ids=x, attention_mask=mask, position_ids=(positions - pad[:, None]).clamp(min=0),
                       use_cache=False).logits


def export_hf_directory(model: HFCausalLM, out: str | Path) -> Path:
    """Write `model` as a Hugging Face model directory (config.json, safetensors weights, and the
    tokenizer files of the directory it was loaded from, if any)."""
    out = Path(out)
    model.hf.save_pretrained(out)
    if model.spec.path is not None:
        for name in COMPANION_FILES:
            if (Path(model.spec.path) / name).is_file():
                shutil.copy2(Path(model.spec.path) / name, out / name)
    return out


def load_tokenizer(spec: HFSpec) -> Any:
    """The tokenizer of the model directory (`spec.brings_tokenizer`), as transformers loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.path)
