"""float8 training (parallel/float8.py). Here on CPU, torch's own float8 matmul runs torchao's
float8 linears for real (slowly): which layers convert, that training follows bf16's, that
checkpoints keep their names, and where the spec and the launch refuse it. Against bf16 on a
GPU of compute capability 8.9+: tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.parallel.float8 import apply_float8, float8_linears, float8_unsupported
from shardyard.spec import SpecError, parse_spec
from helpers.oracle import steps

pytestmark = pytest.mark.timeout(120)

JOB = {"model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32, "tie_weights": False},
       "data": {"name": "synthetic", "num_samples": 128}, "batch": {"global_batch_size": 16, "micro_batch_size": 16},
       "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 1}, "run": {"precision": "bf16", "seed": 1},
       "scaling": {"num_workers": 1}}
STEPS = 8


def test_the_blocks_linears_convert_and_the_head_stays() -> None:
    model = build_model(parse_spec(JOB).model)
    names = float8_linears(model)
    assert names == [f"blocks.{b}.{layer}" for b in "01" for layer in
                     ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc_in", "mlp.fc_out")]
    before = sorted(model.state_dict())
    assert apply_float8(model) == sorted(names)
    assert {type(model.get_submodule(n)).__name__ for n in names} == {"Float8Linear"}
    assert type(model.lm_head).__name__ == "Linear"
    assert sorted(model.state_dict()) == before  # a float8 run's checkpoint resumes in bf16, and back


def losses(float8: bool) -> list[float]:
    spec = parse_spec(JOB)
    torch.manual_seed(spec.run.seed)
    model = build_model(spec.model)
    if float8:
        apply_float8(model)
    return steps(single_process(spec, model, torch.device("cpu")), spec, 0, STEPS)


def test_float8_training_follows_bf16() -> None:
    bf16, float8 = losses(False), losses(True)
    assert bf16[-1] < bf16[0] - 0.05  # it learns, so following it says something
    torch.testing.assert_close(torch.tensor(float8), torch.tensor(bf16), rtol=0.005, atol=0)
    assert float8 != bf16  # the float8 matmuls ran


def test_float8_is_refused_where_it_cannot_run() -> None:
    assert "compute capability 8.9 or later; this worker trains on cpu" in float8_unsupported(torch.device("cpu"))
    for parallelism in ({"strategy": "zero2"}, {"strategy": "tensor", "tp": 2}, {"strategy": "pipeline", "pp": 2}):
        with pytest.raises(SpecError, match="run.precision float8 converts the blocks' linears"):
            parse_spec({**JOB, "parallelism": parallelism, "scaling": {"num_workers": 2},
                        "batch": {"global_batch_size": 16, "micro_batch_size": 4},
                        "run": {"precision": "float8"}})
