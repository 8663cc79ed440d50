"""Small configurations of every model family the tests train (Hugging Face architectures and the
own GPT), their jobs under each strategy, and the single-process oracle they are held to (plain SGD:
a wrong gradient scale shows)."""

from __future__ import annotations

from pathlib import Path

import torch

from shardyard.checkpoint.pretrained import pretrained_weights
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec

from helpers.oracle import steps

STEPS = 3

SGD = {"name": "sgd", "lr": 0.2, "momentum": 0.0, "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 1}


LLAMA = {"architecture": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 64, "tie_word_embeddings": False}


GPT2 = {"architecture": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}


# Plans beyond column/row-wise: Qwen3's per-head q/k norms are replicated with their gradients
# summed over the tp ranks; OLMo-2 gathers q, k and v to normalise them over all heads.
QWEN3 = {**LLAMA, "architecture": "qwen3", "head_dim": 8}

OLMO2 = {**LLAMA, "architecture": "olmo2"}


# A mixture of experts (4 experts, 2 per token): its experts are 3-D parameters of their own, the
# gate and up projections packed in one. Qwen3-MoE's first layer is a dense MLP, its second experts.
MIXTRAL = {**LLAMA, "architecture": "mixtral", "intermediate_size": 48, "num_local_experts": 4,
           "num_experts_per_tok": 2}


QWEN3_MOE = {**QWEN3, "architecture": "qwen3_moe", "moe_intermediate_size": 24, "num_experts": 4,
             "num_experts_per_tok": 2, "mlp_only_layers": [0], "norm_topk_prob": True}


# Llama 4 stores its experts transposed (expert, in, out): the packed projection splits by its last
# dimension (`packed_rowwise`), and a shared expert runs beside the routed ones.
LLAMA4 = {**LLAMA, "architecture": "llama4_text", "head_dim": 8, "intermediate_size": 48,
          "intermediate_size_mlp": 64, "num_local_experts": 4, "num_experts_per_tok": 1,
          "interleave_moe_layer_step": 1}


MODELS = {
    "llama": {"name": "hf", "config": LLAMA, "block_size": 16},
    "qwen3": {"name": "hf", "config": QWEN3, "block_size": 16},
    "olmo2": {"name": "hf", "config": OLMO2, "block_size": 16},
    "gpt2": {"name": "hf", "config": GPT2, "block_size": 16},
    "mixtral": {"name": "hf", "config": MIXTRAL, "block_size": 16},
    "qwen3_moe": {"name": "hf", "config": QWEN3_MOE, "block_size": 16},
    "llama4": {"name": "hf", "config": LLAMA4, "block_size": 16},
    "custom": {"name": "custom", "factory": "custom_model:build", "block_size": 16, "options": {"width": 24}},
    # The same module with the tensor and pipeline hooks (models/stages.py).
    "custom-hooks": {"name": "custom", "factory": "custom_model:build_splittable", "block_size": 16,
                     "options": {"width": 24}},
}


def save_llama(directory: Path, **overrides: object) -> Path:
    """A Llama of the LLAMA config (`overrides` changed), random weights, saved as transformers
    saves a model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = {k: v for k, v in LLAMA.items() if k != "architecture"} | overrides
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **keys)).save_pretrained(directory)
    return directory


def job(model: dict, parallelism: dict, world: int, storage: Path | None = None, steps_: int = STEPS,
        optim: dict = SGD) -> dict:
    raw = {"model": model, "data": {"name": "synthetic", "num_samples": 64}, "optim": optim,
           "batch": {"global_batch_size": 8, "micro_batch_size": 8 // (2 * world)},
           "parallelism": parallelism, "scaling": {"num_workers": world},
           "checkpoint": {"every_n_steps": 2, "keep": 5}, "run": {"steps": steps_, "seed": 3, "log_every": 1}}
    if storage is not None:
        raw["checkpoint"]["storage_path"] = str(storage)
        raw["run"]["name"] = "run"
    return raw


def oracle(model: str, steps_: int = STEPS, optim: dict = SGD) -> tuple[dict[str, torch.Tensor],
                                                                       dict[str, torch.Tensor]]:
    """(initial, final) parameters of `steps_` single-process steps on the whole global batch."""
    raw = job(MODELS[model], {"strategy": "ddp"}, 1, steps_=steps_, optim=optim)  # the LR schedule spans run.steps
    raw["batch"] = {"global_batch_size": 8, "micro_batch_size": 8}
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    engine = single_process(spec, build_model(spec.model, pretrained_weights(spec.model)), torch.device("cpu"))
    initial = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    steps(engine, spec, 0, steps_)
    return initial, engine.model.state_dict()
