"""The canary's decisions, without Ray: which replicas try a checkpoint first, when the verdict
comes, and what it is (the follow drills run a canary across two served replicas)."""

from __future__ import annotations

import pytest

from shardyard.serve.follow.rollout import CANARY, PROMOTE, REFUSE, WAIT, CanarySettings, CanaryTrials, Tally, verdict

SETTINGS = CanarySettings(fraction=0.25, window_s=10.0, min_requests=4, max_error_increase=0.01,
                          max_latency_ratio=1.5, latency_margin_s=0.05)
OLD, NEW = "run@10", "run@20"
# Half the replicas canaries, a verdict after 5 s and 4 requests.
HALF = CanarySettings(fraction=0.5, window_s=5.0, min_requests=4, max_error_increase=0.01, max_latency_ratio=1.5,
                      latency_margin_s=0.05)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def trials_of(replicas: int, settings: CanarySettings = SETTINGS) -> tuple[CanaryTrials, Clock]:
    clock = Clock()
    trials = CanaryTrials(settings, clock)
    for r in range(replicas):
        trials.report(f"r{r}", OLD, {OLD: Tally(10, 0, 1.0)})
    return trials, clock


@pytest.mark.timeout(30)
def test_the_verdict_compares_error_rate_and_mean_latency_with_the_served_weights() -> None:
    assert verdict(Tally(100, 1, 10.0), Tally(100, 0, 10.0), SETTINGS) is None  # 0.99% more errors: within 1%
    assert "failed 2.0% of 100" in verdict(Tally(98, 2, 10.0), Tally(100, 0, 10.0), SETTINGS)
    assert verdict(Tally(10, 0, 1.5), Tally(10, 0, 1.0), SETTINGS) is None  # 1.5x: at the limit
    assert "more than 1.5x" in verdict(Tally(10, 0, 1.6), Tally(10, 0, 1.0), SETTINGS)
    # Milliseconds of a fast model: 1.8x, yet 8 ms, within the margin (a drill's canary was refused so)
    assert verdict(Tally(10, 0, 0.18), Tally(10, 0, 0.10), SETTINGS) is None
    assert "0.05 s slower" in verdict(Tally(10, 0, 0.7), Tally(10, 0, 0.10), SETTINGS)  # 60 ms more
    assert verdict(Tally(10, 0, 9.0), Tally(), SETTINGS) is None  # nothing served beside it to compare


@pytest.mark.timeout(30)
def test_a_share_of_the_replicas_tries_a_checkpoint_then_all_serve_it() -> None:
    trials, clock = trials_of(4)
    roles = {r: trials.role(r, 20, NEW, OLD) for r in ("r0", "r1", "r2", "r3")}
    assert roles == {"r0": CANARY, "r1": WAIT, "r2": WAIT, "r3": WAIT}  # a quarter of 4
    clock.now = 1.0  # no verdict before the canary serves it
    assert trials.role("r1", 20, NEW, OLD) == WAIT
    trials.report("r0", NEW, {OLD: Tally(10, 0, 1.0)})  # serving it from now on: the window opens
    clock.now = 6.0
    trials.report("r0", NEW, {OLD: Tally(10, 0, 1.0), NEW: Tally(5, 0, 0.5)})
    trials.report("r1", OLD, {OLD: Tally(20, 0, 2.0)})
    assert trials.role("r1", 20, NEW, OLD) == WAIT  # the window (10 s) is not over
    assert trials.role("r2", 30, "run@30", OLD) == WAIT  # a newer checkpoint waits for the trial
    clock.now = 11.5
    for r in ("r2", "r3"):
        trials.report(r, OLD, {OLD: Tally(10, 0, 1.0)})
    assert trials.role("r1", 20, NEW, OLD) == PROMOTE
    assert trials.role("r0", 20, NEW, NEW) == PROMOTE
    assert trials.role("r2", 30, "run@30", NEW) == WAIT  # the next trial begins, on r0 again
    assert trials.role("r0", 30, "run@30", NEW) == CANARY


@pytest.mark.timeout(30)
def test_a_canary_that_fails_requests_is_refused_everywhere() -> None:
    trials, clock = trials_of(2, HALF)
    assert trials.role("r0", 20, NEW, OLD) == CANARY
    trials.report("r0", NEW, {OLD: Tally(10, 0, 1.0)})
    clock.now = 6.0
    trials.report("r0", NEW, {OLD: Tally(10, 0, 1.0), NEW: Tally(1, 2, 0.1)})
    assert trials.role("r1", 20, NEW, OLD) == WAIT  # 3 requests: fewer than min_requests
    trials.report("r0", NEW, {OLD: Tally(10, 0, 1.0), NEW: Tally(1, 5, 0.1)})
    trials.report("r1", OLD, {OLD: Tally(30, 0, 3.0)})
    role = trials.role("r1", 20, NEW, OLD)
    assert role.startswith(REFUSE) and "failed 83.3% of 6" in role and "0.0% of 20" in role
    assert trials.role("r0", 20, NEW, NEW) == role


@pytest.mark.timeout(30)
def test_a_checkpoint_refused_by_a_canarys_gate_or_tried_by_the_only_replica() -> None:
    trials, _ = trials_of(2, HALF)
    assert trials.role("r0", 20, NEW, OLD) == CANARY
    trials.refuse(20, "its weights are not finite")
    assert trials.role("r1", 20, NEW, OLD) == REFUSE + "its weights are not finite"
    alone, _ = trials_of(1)
    assert alone.role("r0", 20, NEW, OLD) == PROMOTE  # nobody to compare with


@pytest.mark.timeout(30)
def test_a_trial_whose_canaries_are_gone_picks_again() -> None:
    trials, clock = trials_of(2, HALF)
    assert trials.role("r0", 20, NEW, OLD) == CANARY
    clock.now = 11.0  # r0 stopped reporting (replaced); r1 and a new replica r2 go on
    trials.report("r1", OLD, {})
    trials.report("r2", OLD, {})
    assert trials.role("r1", 20, NEW, OLD) == CANARY
    assert trials.role("r2", 20, NEW, OLD) == WAIT
