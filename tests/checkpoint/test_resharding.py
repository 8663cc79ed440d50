"""A checkpoint written at one world size resumes at another: the state is resharded
(torch.distributed.checkpoint; DeepSpeed's universal checkpoint for ZeRO), gradient accumulation is
recomputed so the global batch stays the same, and each rank picks up its new shard of the
remaining samples. Both runs are the real Trainer over one run directory, as a resized Ray Train
run would be.

Oracle: the whole run must equal STEPS uninterrupted single-process steps. A repeated or skipped
sample, a wrong accumulation count or a bad reshard would each move the parameters off it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardyard.localdist import run_distributed
from shardyard.checkpoint.loaders import committed_record, find_latest, load_model
from shardyard.train.metrics import read_metrics
from helpers.oracle import PARAM_TOL, RESUME_AT, job, oracle_run, train


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallelism, old_world, new_world", [
    # DDP (replicated: nothing to reshard) growing and shrinking, and ZeRO-2 shrinking, are
    # resumed on Ray Train workers in test_elastic.py; ZeRO-1 and ZeRO-3 at another world size in
    # test_strategies.py's cross-strategy matrix.
    ({"strategy": "fsdp"}, 2, 3),  # growing into uneven shards; shrinking: the dp2 x tp2 case
    ({"strategy": "pipeline", "pp": 2}, 4, 3),  # 2 stages x 2 replicas re-planned as 3 replicas
    ({"strategy": "fsdp", "tp": 2}, 4, 2),  # dp 2 x tp 2 -> tp 2 alone: DTensor shards resharded
], ids=lambda v: "-".join(f"{k}{x}" if k != "strategy" else x for k, x in v.items()) if isinstance(v, dict) else str(v))
def test_resume_at_another_world_size_matches_uninterrupted_run(parallelism: dict, old_world: int,
                                                                new_world: int, tmp_path: Path) -> None:
    # Global batch 24, micro-batch 2: accumulation 3, 4, 6 or 12 steps, whatever the world size.
    # One elastic spec for both runs, as a resized Ray Train run would have.
    raw = job(parallelism, old_world, 2) | {"batch": {"global_batch_size": 24, "micro_batch_size": 2}}
    raw["scaling"] = {"min_workers": min(old_world, new_world), "max_workers": max(old_world, new_world)}
    raw["checkpoint"] = {"every_n_steps": RESUME_AT, "storage_path": str(tmp_path)}
    old, new = raw, raw
    if parallelism.get("tp", 1) > 1:  # no elastic range fits tp = 2 (3 ranks would not): two fixed sizes
        old, new = raw | {"scaling": {"num_workers": old_world}}, raw | {"scaling": {"num_workers": new_world}}
    run_distributed(train, old_world, old | {"run": {**raw["run"], "name": "run"}}, RESUME_AT)
    run_distributed(train, new_world, new | {"run": {**raw["run"], "name": "run"}})

    run_dir = tmp_path / "run"
    oracle_losses, oracle_params = oracle_run(raw["model"]["tie_weights"], "adamw", 24)
    losses = [row["loss"] for row in read_metrics(run_dir)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(oracle_losses), rtol=1e-5, atol=0)
    final = find_latest(run_dir)
    assert committed_record(final)["world_size"] == new_world
    trained = load_model(final).state_dict()
    for name, value in oracle_params.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=PARAM_TOL, msg=name)
