"""How a model says it can be cut into pipeline stages: the hook pipeline parallelism (training)
and pipeline sharding (serving) call, the way TorchTitan gives each model family its own split.

A model that pipelines defines two methods:
- `pipeline_layout() -> PipelineLayout`: its repeated blocks in order, and the modules that run
  before them (embeddings) and after them (final norm, head), so stages can be balanced;
- `pipeline_stage(start, end) -> nn.Module`: a copy holding blocks [start, end), plus the first
  modules when start == 0 and the last ones when end == len(blocks). Its forward takes token ids
  on the first stage and hidden states on later ones, and returns hidden states on all but the
  last stage, which returns the model's output. Parameters keep the full model's names, so
  pipeline checkpoints load under every other strategy.
The reference GPT and Hugging Face models (from their `base_model_pp_plan`) define both; a user's
module may too.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class PipelineLayout:
    first: list[nn.Module]
    blocks: list[nn.Module]
    last: list[nn.Module]
