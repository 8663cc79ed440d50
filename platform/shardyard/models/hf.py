"""Hugging Face causal LMs (Llama, Qwen, GPT-2, ... anything `AutoModelForCausalLM` builds) behind
the interface the engines use: token ids in, logits out, repeated blocks named by the model's own
`_no_split_modules`, tensor-parallel plan from `base_model_tp_plan`, pipeline stages from
`base_model_pp_plan` (models/stages.py).

The wrapper adds one level to parameter names (`hf.`); `export_hf_directory` strips it again, so
what leaves the platform is an ordinary Hugging Face model directory.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from shardyard.layout.capabilities import hf_block_tp_plan
from shardyard.models.kv_cache import KVCache
from shardyard.models.stages import PipelineLayout
from shardyard.spec import HFSpec

# Files a model directory may carry besides config and weights: the tokenizer travels with them.
COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


# transformers' sdpa attention, except in a pass over the serving engine's KV cache, where the
# cache attends (models/kv_cache.py `attend`: query heads read the key head they share without a
# copy, whichever transformers is installed; 5.19, which vLLM pins, copies it per query head under
# a mask). Registered under its own name with sdpa's masks, so that training and every pass
# without the engine's cache run as under sdpa.
PAGED_ATTENTION = "shardyard_paged"


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, engine_cache: KVCache | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    if engine_cache is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    out = engine_cache.attend(str(module.layer_idx), query, key, value, kwargs.get("scaling"))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(PAGED_ATTENTION, paged_attention)
AttentionMaskInterface.register(PAGED_ATTENTION, sdpa_mask)


class HFCausalLM(nn.Module):
    def __init__(self, spec: HFSpec) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.spec = spec
        # From the config (a model directory's too): its weights are the checkpoint side's to read
        # (checkpoint/pretrained.py), or drawn again, unit by unit, by models.materialise.
        self.hf = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)
        # One the config asked for (eager, flash) stays, and so does sdpa for a model whose scores
        # are soft-capped (Gemma 2), which the cache's attention does not compute.
        config = self.hf.config
        if config._attn_implementation == "sdpa" and getattr(config, "attn_logit_softcapping", None) is None:
            self.hf.set_attn_implementation(PAGED_ATTENTION)
        # Blocks FSDP wraps and activation checkpointing recomputes: the model's own decoder layers.
        self._no_split_modules = tuple(self.hf._no_split_modules or ())
        # A pipeline stage after the first takes hidden states; one before the last returns them.
        self.takes_hidden = self.returns_hidden = False

    @property
    def cache_attends(self) -> bool:
        """Whether every layer's attention over the serving engine's KV cache is the cache's own
        (`paged_attention`), so that the engine may pack prompt chunks and decode steps into one
        pass; a model attending itself gets the past through `EngineCache` as a batch of rows."""
        return self.hf.config._attn_implementation == PAGED_ATTENTION

    def reset_weights(self, module: nn.Module) -> None:
        """Initialise `module` (a part of this model, whole) as transformers initialises the
        model: the model's `_init_weights` on each submodule, children before their parents."""
        with torch.no_grad():
            for sub in reversed(list(module.modules())):
                self.hf._init_weights(sub)

    def compute_buffers(self) -> None:
        """Non-persistent buffers (rotary frequencies), which neither the directory nor a
        checkpoint holds, for a model given storage by `to_empty`: the model's own initialisation
        of each module that holds one (and of nothing else: the weights come after)."""
        owners = {name.rpartition(".")[0] for name, _ in self.hf.named_non_persistent_buffers()}
        with torch.no_grad():
            for owner in owners:
                self.hf._init_weights(self.hf.get_submodule(owner))

    @property
    def block_tp_plan(self) -> dict[str, str]:
        """The model's own plan for tensor parallelism, per decoder layer (the spec has checked it
        fits parallelism.tp before any worker started)."""
        return hf_block_tp_plan(self.spec)

    def _pp_sections(self) -> tuple[list[str], str, list[str]]:
        """Names in the base model of the modules before the decoder layers, of the layers, and
        of those after them, in the order of the model's `base_model_pp_plan` (the spec has
        checked the model has one)."""
        base, names = self.hf.base_model, list(self.hf.config.base_model_pp_plan)
        at = next(i for i, name in enumerate(names) if isinstance(getattr(base, name), (nn.ModuleList, SparseLayers)))
        return names[:at], names[at], names[at + 1:]

    def pipeline_layout(self) -> PipelineLayout:
        base = self.hf.base_model
        before, layers, after = self._pp_sections()
        return PipelineLayout(first=[getattr(base, n) for n in before], blocks=list(getattr(base, layers)),
                              last=[getattr(base, n) for n in after] + [self.hf.get_output_embeddings()])

    def pipeline_stage(self, start: int, end: int) -> HFCausalLM:
        """A copy keeping decoder layers [start, end) under their own indices. A later stage drops
        the embeddings and feeds hidden states to the base model as `inputs_embeds`; an earlier
        one drops the head and turns the final norm into the identity (the base model calls it
        unconditionally), returning the base model's hidden states. Transformers runs the rest
        (rotary embeddings, causal and padding masks) as in the whole model."""
        stage = copy.deepcopy(self)
        base = stage.hf.base_model
        before, layers, after = stage._pp_sections()
        n = len(getattr(base, layers))
        setattr(base, layers, SparseLayers(getattr(base, layers), range(start, end)))
        if start > 0:
            for name in before:
                setattr(base, name, None)
            stage.takes_hidden = True
        if end < n:
            for name in after:
                setattr(base, name, nn.Identity())
            head = next(name for name, child in stage.hf.named_children()
                        if child is stage.hf.get_output_embeddings())
            setattr(stage.hf, head, None)
            stage.returns_hidden = True
        return stage

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); on a pipeline stage, hidden states in or out.
        `pad` (B,) counts each row's left padding (a batch of ragged prompts, as serving sends):
        masked out, and positions start at each row's first real token, so a row's logits equal
        its prompt's alone (as GPT.forward's).
        `cache`: decoding with the serving engine's KV cache (its current step says which rows and
        positions), which the model's attention layers write through `EngineCache`; the logits are
        then each sequence's last position's only, (sequences, 1, V)."""
        kwargs: dict[str, Any] = {"inputs_embeds" if self.takes_hidden else "input_ids": x, "use_cache": False}
        if cache is not None:
            # Every row has its own length, so the positions and the 4-D mask (which transformers
            # takes as given) come from the cache, not from transformers' one-length-fits-all logic.
            dtype = next(self.hf.parameters()).dtype
            # The cache masks its own attention; any 4-D mask keeps transformers from building one.
            if self.cache_attends:
                kwargs["engine_cache"] = cache
                mask = torch.zeros((1, 1, 1, 1), dtype=dtype, device=x.device)
            else:  # additive, which every attention implementation (eager and sdpa) takes
                allowed = cache.attention_mask(x.shape[1], x.device)
                mask = torch.zeros(allowed.shape, dtype=dtype, device=x.device)
                mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
            kwargs.update(use_cache=True, past_key_values=EngineCache(cache, stores=not self.cache_attends),
                          position_ids=cache.positions(x.shape[1], x.device), attention_mask=mask)
        elif pad is not None:
            positions = torch.arange(x.shape[1], device=x.device)[None, :]
            kwargs["attention_mask"] = (positions >= pad[:, None]).long()
            kwargs["position_ids"] = (positions - pad[:, None]).clamp(min=0)
        if self.returns_hidden:
            return self.hf.base_model(**kwargs).last_hidden_state
        if cache is not None:  # only each sequence's next token's logits: (sequences, 1, V)
            return cache.last_logits(self.hf(**kwargs, logits_to_keep=cache.logits_to_keep()).logits)
        return self.hf(**kwargs).logits


class EngineCache(Cache):
    """The serving engine's KV cache (models/kv_cache.py: a pool of blocks, each request's named by its block table) behind
    transformers' `Cache` interface, through which every attention layer of a transformers model
    stores its new keys and values and gets back the past to attend over. Layers are keyed by
    their index in the whole model, so a pipeline stage's layers keep their own. Under
    `paged_attention` (not `stores`), the attention stores them and reads the past itself: the new
    keys and values pass through."""

    def __init__(self, cache: KVCache, stores: bool = True) -> None:
        super().__init__(layers=[])
        self.engine_cache, self.stores = cache, stores

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.stores:
            return key_states, value_states
        return self.engine_cache.update(str(layer_idx), key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.engine_cache.past


class SparseLayers(nn.Module):
    """Some of a model's decoder layers, registered under their indices in the whole model (so a
    pipeline stage's parameter names are the whole model's). Iterates and slices like the
    `nn.ModuleList` it replaces, which is how transformers' forward walks its layers."""

    def __init__(self, layers: nn.ModuleList, keep: range) -> None:
        super().__init__()
        for index in keep:
            self.add_module(str(index), layers[index])

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int | slice) -> nn.Module | list[nn.Module]:
        return list(self._modules.values())[index]


def export_hf_directory(model: HFCausalLM, out: str | Path, tokenizer_dir: Path | None = None) -> Path:
    """Write `model` as a Hugging Face model directory (config.json, safetensors weights, and the
    tokenizer files of `tokenizer_dir` (the run's data was tokenized with it) or else of the
    directory the model was loaded from, if any)."""
    out = Path(out)
    model.hf.save_pretrained(out)
    source = tokenizer_dir or (Path(model.spec.path) if model.spec.path is not None else None)
    if source is not None:
        for name in COMPANION_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
    return out


def load_tokenizer(spec: HFSpec) -> Any:
    """The tokenizer of the model directory (`spec.brings_tokenizer`), as transformers loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec.path)
