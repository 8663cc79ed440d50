"""What each model family can be split into, asked of its spec section before any worker starts
(the job spec's validation calls these) and by serving before it splits a model: how many blocks
pipeline stages divide, and whether tensor parallelism can split it `tp` ways. Each family's own
rule: the GPT's heads and tied head, a Hugging Face model's own plans (`base_model_pp_plan`,
`base_model_tp_plan`, read from its config: transformers is imported for Hugging Face models
only), a custom module's hooks (asked of a copy built on the meta device), and the MLP's none.

Sections are told apart by their `name`, so this module needs nothing from the spec module,
which calls it.
"""

from __future__ import annotations

from typing import Any

# The styles of transformers' tensor-parallel plans that parallel/tensor.py applies.
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce",
             "packed_colwise", "packed_rowwise", "moe_tp_experts")
DATA_PARALLEL_ONLY = "use ddp, fsdp, local_sgd or zero1/2/3"


def refuse_unknown_styles(plan: dict[str, str], whose: str) -> None:
    """ValueError naming the styles of `plan` that parallel/tensor.py does not apply, if any."""
    if unsupported := sorted({style for style in plan.values() if style not in TP_STYLES}):
        raise ValueError(f"{whose} uses {unsupported}; shardyard applies {', '.join(TP_STYLES)} (parallel/tensor.py)")


def pipeline_blocks(model: Any, training: bool = True) -> int:
    """How many blocks pipeline stages split, or ValueError saying why this model cannot be
    pipelined. (Serving, `training=False`, splits a model with a tied head too: each end keeps
    its own copy.)"""
    if model.name == "gpt":
        if training and model.tie_weights:
            raise ValueError("pipeline stages cannot share the embedding with the output head: "
                             "set model.tie_weights=false, for a new run (a run trained with tied weights "
                             "keeps them: resume it under another strategy, or give the new run its own "
                             "run.name)")
        return model.n_layer
    if model.name == "hf":
        config = model.hf_config()
        if not getattr(config, "base_model_pp_plan", None):
            raise ValueError(f"model '{config.model_type}' ships no pipeline plan (base_model_pp_plan): "
                             f"use parallelism.pp 1 with ddp, fsdp, tensor or zero")
        if training and getattr(config, "tie_word_embeddings", False):
            raise ValueError("pipeline stages cannot share the input embedding with the output head: "
                             "set model.config.tie_word_embeddings false (a model directory that ties "
                             "them cannot be pipelined)")
        return config.num_hidden_layers
    if model.name == "custom":
        module = _skeleton(model)
        if not (callable(getattr(module, "pipeline_layout", None)) and callable(getattr(module, "pipeline_stage", None))):
            raise ValueError(f"model.factory's module ({type(module).__name__}) does not say how to split it "
                             f"into pipeline stages: give it pipeline_layout() and pipeline_stage(start, end) "
                             f"(docs/models.md), or {DATA_PARALLEL_ONLY}")
        return len(module.pipeline_layout().blocks)
    if model.name == "module":
        raise ValueError(f"a module of the user's own (model.name 'module') is not split into pipeline stages: "
                         f"{DATA_PARALLEL_ONLY}")
    raise ValueError(f"pipeline parallelism splits a language model's blocks; for model.name "
                     f"'{model.name}' {DATA_PARALLEL_ONLY}")


def check_tensor_parallel(model: Any, tp: int, key: str = "parallelism.tp") -> None:
    """ValueError saying why the model cannot be split `tp` ways (`key` names that number)."""
    if model.name == "gpt":
        if model.n_head % tp:
            raise ValueError(f"model.n_head ({model.n_head}) must be divisible by {key} ({tp}) to shard "
                             f"attention heads")
    elif model.name == "hf":
        hf_block_tp_plan(model, tp, key)
    elif model.name == "custom":
        _check_custom_tp_plan(model)
    elif model.name == "module":
        raise ValueError(f"a module of the user's own (model.name 'module') is not split by tensor parallelism: "
                         f"{DATA_PARALLEL_ONLY}")
    else:
        raise ValueError(f"tensor parallelism follows a model's plan and the {model.name.upper()} has none; "
                         f"for model.name '{model.name}' {DATA_PARALLEL_ONLY}")


def check_fits_mesh(model: Any, parallelism: Any) -> None:
    """ValueError if the model cannot take the tensor and pipeline degrees `parallelism` asks."""
    par = parallelism
    if par.tp > 1:
        check_tensor_parallel(model, par.tp)
    if par.pp > 1:
        blocks = pipeline_blocks(model)
        if blocks < par.num_stages:
            raise ValueError(f"the model's {blocks} blocks cannot be split into "
                             f"{par.num_stages} pipeline stages (pp x stages_per_rank)")
        points = par.split_points
        if points is not None and (len(points) != par.num_stages - 1 or points != sorted(set(points))
                                   or points[0] < 1 or points[-1] >= blocks):
            raise ValueError(f"parallelism.split_points must be {par.num_stages - 1} increasing "
                             f"block indices between 1 and {blocks - 1}, got {points}")


def hf_block_tp_plan(model: Any, tp: int = 1, key: str = "parallelism.tp") -> dict[str, str]:
    """The tensor-parallel plan of one decoder layer of a Hugging Face model, from its own
    `base_model_tp_plan` ("layers.*.self_attn.q_proj": "colwise" -> "self_attn.q_proj": "colwise"),
    or ValueError saying why the model cannot be split `tp` ways."""
    config = model.hf_config()
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"model '{config.model_type}' ships no tensor-parallel plan "
                         f"(base_model_tp_plan): use parallelism.tp 1 with ddp, fsdp or zero")
    block_plan = {name.split(".*.", 1)[1]: style for name, style in plan.items() if ".*." in name}
    refuse_unknown_styles(block_plan, f"model '{config.model_type}': its tensor-parallel plan")
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, name, None)
        if heads is not None and heads % tp:
            raise ValueError(f"model.config {name} ({heads}) must be divisible by {key} ({tp})")
    if "moe_tp_experts" in block_plan.values():  # each rank takes the same share of every expert
        name = "moe_intermediate_size" if hasattr(config, "moe_intermediate_size") else "intermediate_size"
        if getattr(config, name) % tp:
            raise ValueError(f"model.config {name} ({getattr(config, name)}) must be divisible by {key} ({tp})")
    return block_plan


def _skeleton(model: Any) -> Any:
    """The user's module on the meta device (no memory, no init): enough to ask what it supports."""
    import torch

    with torch.device("meta"):
        return model.build()


def _check_custom_tp_plan(model: Any) -> None:
    from shardyard.layout.blocks import repeated_blocks

    module = _skeleton(model)
    whose = f"model.factory's module ({type(module).__name__})"
    if not isinstance(getattr(module, "block_tp_plan", None), dict):
        raise ValueError(f"{whose} has no tensor-parallel plan: give it block_tp_plan ({{'linear name in a "
                         f"block': 'colwise' | 'rowwise'}}, docs/models.md), or {DATA_PARALLEL_ONLY}")
    blocks = [getattr(parent, name) for parent, name in repeated_blocks(module)]
    names = {name for block in blocks for name, _ in [*block.named_modules(), *block.named_parameters()]}
    if unknown := sorted(entry for entry in module.block_tp_plan if entry not in names):
        raise ValueError(f"{whose}: block_tp_plan names {unknown}, which no block (_no_split_modules) holds")
    refuse_unknown_styles(module.block_tp_plan, f"{whose}: block_tp_plan")
