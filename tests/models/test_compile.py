"""parallelism.compile (parallel/compile.py): each block compiled, nothing else changed. Its
math against single-process training is in test_strategies.py (ddp-compiled, fsdp-compiled)."""

from __future__ import annotations

import pytest
import torch

from shardyard.localdist import run_distributed
from shardyard.spec import SpecError, parse_spec

pytestmark = pytest.mark.timeout(120)

JOB = {"model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
       "data": {"name": "synthetic", "num_samples": 64}, "batch": {"global_batch_size": 8, "micro_batch_size": 4}}


def compiled_step(rank: int, world: int, strategy: str) -> dict:
    """One DDP or FSDP step with compiled blocks: which modules carry compiled code, the graphs
    Dynamo made, the parameter names the checkpoint would hold."""
    from torch._dynamo.utils import counters

    from shardyard.models import build_model
    from shardyard.parallel import build_engine

    spec = parse_spec({**JOB, "parallelism": {"strategy": strategy, "compile": True},
                       "scaling": {"num_workers": world}})
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    tokens = torch.randint(0, 256, (4, 17))
    engine.train_step([(tokens[:, :-1], tokens[:, 1:])])
    # (FSDP2 renames each block's class, so its blocks are found by position.)
    return {"compiled": [type(m).__name__ for m in engine.module.modules() if m._compiled_call_impl is not None],
            "graphs": counters["stats"]["unique_graphs"],
            "names": sorted(engine.module.state_dict())}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_each_block_is_compiled_and_the_checkpoint_names_stay(strategy: str) -> None:
    from shardyard.models import build_model

    result = run_distributed(compiled_step, 2, strategy)[0]
    assert result["compiled"] == [f"{'FSDP' if strategy == 'fsdp' else ''}Block"] * 2 and result["graphs"] >= 1
    assert result["names"] == sorted(build_model(parse_spec(JOB).model).state_dict())


@pytest.mark.parametrize("parallelism", [{"strategy": "zero2"}, {"strategy": "parameter_server"},
                                         {"strategy": "pipeline", "pp": 2}])
def test_compile_under_a_strategy_that_wraps_blocks_its_own_way_is_refused(parallelism: dict) -> None:
    with pytest.raises(SpecError, match="parallelism.compile compiles each block before the data-parallel wrapper"):
        parse_spec({**JOB, "parallelism": {**parallelism, "compile": True}, "scaling": {"num_workers": 2}})
