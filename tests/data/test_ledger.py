"""The sample ledger's audit picks, for each step, the round the final model descends from; here on
ledgers written by hand in the shapes runs produced (the Ray runs audit real ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardyard.data.ledger import SampleLedger, audit


def step(ledgers: dict[str, SampleLedger], writers: list[str], number: int, quorum: int, world: int = 2) -> None:
    """`writers` train `number` in `quorum`, each on its share of the step's 4 samples, and commit."""
    share = 4 // world
    for rank, name in enumerate(writers):
        first = (number - 1) * 4 + rank * share
        ledgers[name].training(number, world, [torch.arange(first, first + share)], quorum, dp_rank=rank)
    for name in writers:
        ledgers[name].committed(number, quorum)


@pytest.mark.timeout(60)
def test_a_branch_healed_away_is_not_the_trajectory_and_is_not_divergence(tmp_path: Path) -> None:
    """Hot recovery, as seen in a run: rank0 is busy writing the checkpoint of step 1 while ranks
    1 and 2 commit step 2 in quorum 4; rank 2 dies; its replacement (same file) and rank0 form
    quorum 6 and commit step 2 again; rank0 then heals from rank1 at step 3 and all go on. The
    final model descends from quorum 4's step 2 (the audit used to take the latest quorum, 6, and
    count a divergence)."""
    ledgers = {name: SampleLedger(str(tmp_path), name, attempt=0.0) for name in ("rank0", "rank1", "rank2")}
    step(ledgers, ["rank0", "rank1", "rank2"], 1, quorum=3, world=1)  # every replica alone: 4 samples each
    step(ledgers, ["rank1", "rank2"], 2, quorum=4)
    step(ledgers, ["rank1", "rank2"], 3, quorum=4)
    step(ledgers, ["rank0", "rank2"], 2, quorum=6)  # the replacement and rank0: a branch
    step(ledgers, ["rank0", "rank1"], 4, quorum=7)  # rank0 healed to 3 from rank1
    report = audit(tmp_path, num_samples=4)
    assert report.diverged_steps == 0 and report.steps == 4
    assert report.world_sizes == [1, 2, 2, 2]

    # Had both branches gone on together into one quorum, replicas holding different models
    # would train as one: that is divergence.
    step(ledgers, ["rank1", "rank2"], 5, quorum=8)
    ledgers["rank0"].committed(4, 9)
    ledgers["rank2"].committed(4, 9)
    step(ledgers, ["rank0", "rank2"], 5, quorum=9)
    assert audit(tmp_path, num_samples=4).diverged_steps == 1
