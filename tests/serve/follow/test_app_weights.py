"""The app-wide record of a followed app's weights, without Ray: what the app promoted (where a
replica started later begins, what a rollback goes back to), refusals, and the operator's pin
(the follow drills run it across two served replicas)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.followed_run import commit
from shardyard.checkpoint.published import Published
from shardyard.checkpoint.record import checkpoint_name
from shardyard.serve.follow.app_weights import AppWeightsState, rollback_target, starting_checkpoint
from shardyard.serve.resolved import load_config
from shardyard.spec import GPTSpec

RUN = Path("/runs/r")


def at(step: int) -> Path:
    return RUN / checkpoint_name(step)


@pytest.mark.timeout(30)
def test_a_slow_replica_finishing_an_older_swap_does_not_move_the_app_back() -> None:
    state = AppWeightsState()
    for step in (10, 20, 10, 20, 30):
        state.promote(at(step))
    assert state.promoted == [at(10), at(20), at(30)]


@pytest.mark.timeout(30)
def test_a_pin_serves_everywhere_and_no_follower_promotes_what_it_passed_over() -> None:
    state = AppWeightsState()
    state.promote(at(10))
    state.promote(at(20))
    state.refuse(30, "not finite")
    first = state.pin_to(at(10), follow_after=30)
    assert (first.serial, first.step, state.promoted[-1]) == (1, 10, at(10))
    state.promote(at(20))  # a replica that was still swapping in step 20 when the operator rolled back
    assert state.promoted[-1] == at(10)
    second = state.pin_to(at(30), follow_after=30)  # the operator's promotion of a refused step
    assert second.serial == 2 and 30 not in state.refused
    view = state.look("r1", "run@30", now=0.0)
    assert view.pin == second and view.promoted[-1] == at(30)
    state.promote(at(40))  # a step committed after the pin: followed again
    assert state.promoted[-1] == at(40)


@pytest.mark.timeout(30)
def test_rollback_goes_to_the_last_promoted_weights_that_are_neither_served_nor_refused() -> None:
    promoted = [at(10), at(20), at(30), at(20)]  # 30 rolled back to 20 once
    assert rollback_target(promoted, 20, {}) == at(30)
    assert rollback_target(promoted, 20, {30: "canary: failed"}) == at(10)
    assert rollback_target([at(10)], 10, {}) is None


@pytest.mark.timeout(30)
def test_replicas_serving_counts_only_the_live_ones() -> None:
    state = AppWeightsState()
    state.look("r1", "run@10", now=0.0)
    state.look("r2", "run@20", now=5.0)
    state.look("gone", "run@20", now=-100.0)
    assert state.serving_count("run@20", now=6.0) == (1, 2)
    assert state.serving_count("run@10", now=6.0) == (1, 2)
    assert state.live(now=12.0) == {"r2": "run@20"}


@pytest.mark.timeout(120)
def test_a_replica_started_later_begins_on_the_weights_the_app_serves(tmp_path: Path) -> None:
    run_dir = tmp_path / "gpt_ddp"
    for step in (10, 20):
        commit(run_dir, step, overrides=())
    state = AppWeightsState()
    assert starting_checkpoint(state.look("r", "", 0.0), str(run_dir)) is None  # nothing promoted: the newest
    state.promote(run_dir / checkpoint_name(10))
    assert starting_checkpoint(state.look("r", "", 0.0), str(run_dir)) == run_dir / checkpoint_name(10)
    published = Published("gpt_ddp", 20, GPTSpec(), [])
    state.promote(published)  # published weights: the run's checkpoint of their step
    assert starting_checkpoint(state.look("r", "", 0.0), str(run_dir)) == run_dir / checkpoint_name(20)
    state.promote(run_dir / checkpoint_name(30))  # pruned, or never committed: the one before
    assert starting_checkpoint(state.look("r", "", 0.0), str(run_dir)) == run_dir / checkpoint_name(20)
    config = load_config({"checkpoint": str(run_dir)}, use_gpu=False).starting_at(run_dir / checkpoint_name(10))
    assert (config.served_step, config.fingerprint, config.following) == (10, "gpt_ddp@10", True)
    assert (config.checkpoint, config.source) == (str(run_dir / checkpoint_name(10)), str(run_dir))


@pytest.mark.timeout(30)
def test_only_the_two_newest_published_versions_stay_referenced_however_many_are_published() -> None:
    """Each published version's reference pins a whole model in Ray's object store: the app's
    promotions and a replica's served list keep the current and the previous one only (paths,
    which hold nothing, stay), so a run publishing every few steps does not fill the store."""
    import gc
    import weakref

    from shardyard.serve.follow.app_weights import with_few_published

    state, served, alive = AppWeightsState(), [], []
    for step in range(1, 31):
        published = Published("gpt_ddp", step, GPTSpec(), [])
        alive.append(weakref.ref(published))
        state.put(published)
        state.promote(published)
        served = with_few_published([*served, published])
        if step == 10:
            state.promote(Path("runs/gpt_ddp") / checkpoint_name(11))  # a committed checkpoint between
        del published
    gc.collect()
    assert [s.step for s in served] == [29, 30]
    assert [s.step if isinstance(s, Published) else s.name for s in state.promoted] == [checkpoint_name(11), 29, 30]
    assert [ref() is not None for ref in alive].count(True) == 2  # 28 versions let go: Ray frees them
    assert rollback_target(state.promoted, 30, {}).step == 29


def test_a_publish_of_a_launch_that_lost_the_run_never_replaces_the_new_holders() -> None:
    """A launch taken over publishes until it notices (its next lease look): its trajectory,
    discarded, went further than the new holder's first steps. The newer generation's weights
    stay, at any step; the old one's are refused however far they got."""
    state = AppWeightsState()
    state.put(Published("gpt_ddp", 10, GPTSpec(), [], generation=2))
    state.put(Published("gpt_ddp", 40, GPTSpec(), [], generation=1))  # the stale launch, further on
    assert (state.published.generation, state.published.step) == (2, 10)
    state.put(Published("gpt_ddp", 12, GPTSpec(), [], generation=2))
    assert state.published.step == 12
    # Within a launch, a newer worker group (Ray Train gave up on the first) wins the same way.
    state.put(Published("gpt_ddp", 11, GPTSpec(), [], generation=2, attempt=2))
    state.put(Published("gpt_ddp", 13, GPTSpec(), [], generation=2, attempt=1))  # the zombie group, on
    assert (state.published.writer, state.published.step) == ((2, 2), 11)
