"""Workers leave and join a running group at step boundaries, without a restart or a checkpoint:
three leaves (rank 0 among them) and three joins, under DDP and FSDP2, end on the parameters one
process trains with plain SGD on the same global batches, and the sample ledger is exact; under
DDP a worker killed mid-run is left out and the survivors go on, a replacement joining later; an
error of the training code is not taken for a lost worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers.elastic_group import FINAL, LocalGroup, wait_for
from helpers.oracle import ADAMW, ADAMW_PARAM_TOL, job
from helpers.oracle import steps as oracle_steps

from shardyard.data.ledger import audit
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec
from shardyard.train.callbacks import held_at, release

STEPS, GLOBAL_BATCH, SAMPLES = 14, 12, 96
# Plain SGD without clipping: its update is linear in the gradient, so a wrong gradient scale, a
# lost rank's share or a repeated batch moves parameters far past this tolerance.
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 1}
TOLERANCE = 1e-6
# (hold step, leaving, joining): world sizes 3 -> 2 -> 3 -> 2 (rank 0 leaves) -> 3 -> 2 -> 3.
CHANGES = [(2, ["c"], []), (4, [], ["d"]), (6, ["a"], []), (8, [], ["e"]), (10, ["d"], []), (12, [], ["f"])]
WORLD_SIZES = [3, 3, 2, 2, 3, 3, 2, 2, 3, 3, 2, 2, 3, 3]  # of each step, as the changes make them


def elastic_job(strategy: str, storage: Path) -> dict:
    raw = job({"strategy": strategy}, 3, 1, SGD)
    raw["data"] = {"name": "synthetic", "num_samples": SAMPLES}
    raw["batch"] = {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 1}
    raw["checkpoint"] = {"every_n_steps": 7, "keep": 5, "storage_path": str(storage)}  # one inside a generation
    raw["run"] = {**raw["run"], "steps": STEPS, "name": "run", "sample_ledger": True}
    return raw


def one_process(raw: dict) -> dict[str, torch.Tensor]:
    raw = {**raw, "batch": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH},
           "parallelism": {"strategy": "ddp"}, "scaling": {"num_workers": 1}}
    spec = parse_spec(raw)
    torch.manual_seed(spec.run.seed)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    oracle_steps(engine, spec, 0, STEPS)
    return engine.model.state_dict()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy, optimizer", [("ddp", SGD), ("fsdp", SGD), ("fsdp", ADAMW)],
                         ids=["ddp-sgd", "fsdp-sgd", "fsdp-adamw"])
def test_three_leaves_and_three_joins_train_as_one_process(strategy: str, optimizer: dict, tmp_path: Path) -> None:
    """AdamW besides: its state (FSDP's shards of it) is gathered and dealt again at each change."""
    raw = elastic_job(strategy, tmp_path / "runs") | {"optim": optimizer}
    group = LocalGroup(["a", "b", "c"], raw, [step for step, _, _ in CHANGES], tmp_path)
    for step, leave, join in CHANGES:
        group.at_hold(step, leave=leave, join=join)
    codes = group.finish()
    assert codes == dict.fromkeys("abcdef", 0), codes

    regroups = group.regroups()
    assert [(e["step"], e["world_size"], e["members"]) for e in regroups] == [
        (2, 2, ["a", "b"]), (4, 3, ["a", "b", "d"]), (6, 2, ["b", "d"]), (8, 3, ["b", "d", "e"]),
        (10, 2, ["b", "e"]), (12, 3, ["b", "e", "f"])]
    report = audit(tmp_path / "runs" / "run", SAMPLES)
    assert report.world_sizes == WORLD_SIZES and report.attempts == 1, report
    assert report.exact and report.complete_epochs == 1, report

    final = torch.load(tmp_path / FINAL)
    expected = one_process(raw)
    worst = max((final[k] - expected[k]).abs().max().item() for k in expected)
    limit = TOLERANCE if optimizer is SGD else ADAMW_PARAM_TOL  # see helpers/oracle.py on AdamW's
    assert worst <= limit, f"parameters differ from one process's by up to {worst:.2e}"


@pytest.mark.timeout(240)
def test_a_killed_ddp_worker_is_left_out_and_a_replacement_joins(tmp_path: Path) -> None:
    raw = elastic_job("ddp", tmp_path / "runs")
    group = LocalGroup(["a", "b", "c"], raw, [3, 5, 9], tmp_path)
    group.lose_at_hold(3, "a")  # rank 0: the survivors' collective with it fails, and b holds the state
    group.at_hold(5, join=["d"])
    group.lose_at_hold(9, "d")
    codes = group.finish()
    assert codes == {"a": -9, "b": 0, "c": 0, "d": -9}, codes

    assert [(e["step"], e["members"]) for e in group.regroups()] == [(3, ["b", "c"]), (5, ["b", "c", "d"]),
                                                                   (9, ["b", "c"])]
    report = audit(tmp_path / "runs" / "run", SAMPLES)
    assert report.world_sizes == [3, 3, 3, 2, 2, 3, 3, 3, 3, 2, 2, 2, 2, 2] and report.exact, report
    final = torch.load(tmp_path / FINAL)
    expected = one_process(raw)
    worst = max((final[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= TOLERANCE, f"parameters differ from one process's by up to {worst:.2e}"


@pytest.mark.timeout(120)
def test_an_error_of_the_training_code_stands_at_once(tmp_path: Path) -> None:
    """A RuntimeError of one worker's training code looks like a failed collective (gloo's are
    RuntimeErrors too): the worker hears every member's beat, so none was lost, and the error
    ends it within seconds, not after the two minutes a new generation is waited for."""
    group = LocalGroup(["a", "b"], elastic_job("ddp", tmp_path / "runs"), [2], tmp_path, fail_at={"b": 3})
    wait_for(lambda: held_at(group.run, 2) is not None, "the run to hold at step 2")
    released = time.monotonic()
    release(group.run, 2)
    group.processes["b"].join(60)
    ended_after = time.monotonic() - released
    codes = group.finish(timeout_s=0)
    assert codes["b"] == 1 and ended_after < 30, (codes, ended_after)
