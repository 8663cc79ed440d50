"""Elasticity driven by Ray's autoscaler: an elastic run (2 to 4 workers) on a cluster with room
for 2 asks for 4; the autoscaler adds nodes and the run grows; a preemption notice for one of them
(`ray drain-node`) makes the run checkpoint at once, and when the node is reclaimed the run goes on
smaller from that checkpoint; once the run ends the autoscaler removes the idle nodes. The
scenario is the recovery benchmark's (benchmarks/recovery.py, `measure_autoscaled`), on Ray's fake
multi-node provider (tests/helpers/fake_cluster.py): the real autoscaler, nodes that are raylets on
this machine.

Checked: the run grew to 4 on the nodes the autoscaler added; the drain checkpoint is the one the
smaller group restored (nothing recomputed); every sample of each epoch used exactly once on the
final trajectory, the global batch unchanged, and the final model equal to single-process
training.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.elastic import GLOBAL_BATCH, NUM_SAMPLES, assert_matches_single_process, events, job
from shardyard.data.ledger import audit

from helpers.autoscaled import measure_autoscaled

STEPS = 100


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_the_autoscaler_grows_the_run_and_a_drained_node_shrinks_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "autoscaled"
    resizes = measure_autoscaled(job(tmp_path, "autoscaled", "ddp", STEPS), run_dir)

    starts = [e for e in events(run_dir) if e["event"] == "start"]
    sizes = [e["world_size"] for e in starts]
    assert sizes[0] == 2 and 4 in sizes, starts  # room for 2 at first; 4 once the nodes came
    drain = next(e for e in events(run_dir) if e["event"] == "drain_checkpoint")
    after_drain = [e for e in starts if e["time"] > drain["time"]]
    assert after_drain and after_drain[0]["world_size"] == 3, starts
    assert after_drain[0]["restored_step"] == drain["step"], (drain, after_drain)
    assert all(e["global_batch"] == GLOBAL_BATCH for e in starts)

    report = audit(run_dir, NUM_SAMPLES)
    assert report.steps == STEPS and report.exact, report
    assert_matches_single_process(run_dir, STEPS)
    assert [r["resize"] for r in resizes][1:] == ["notice heard -> checkpoint committed",
                                                  "shrink 4 -> 3", "idle nodes removed"]
    assert all(r["s"] > 0 for r in resizes), resizes
