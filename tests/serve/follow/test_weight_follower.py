"""The weight follower and its gate (serve/follow/follower.py, serve/follow/gate.py) without Ray
Serve: a replica's follower over the built-in engine in this process, the app-wide AppWeights
called here (in a served app, through its deployment handle), following a run as it commits;
the operator's rollback and promotion as the admin routes call them. The same journeys over HTTP
in served apps: tests/drills/test_follow_drills.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from helpers.followed_run import PROMPT, alone, commit
from helpers.engine import run_closing
from shardyard.checkpoint.layout import read_spec
from shardyard.checkpoint.record import checkpoint_name
from shardyard.serve.generation import Completion, decode, encode
from shardyard.serve.follow.follower import OperatorRefused, WeightFollower
from helpers.followed_run import follower_of

TOKENS = 12


async def answer(follower: WeightFollower) -> str:
    generation = follower.gate.engine.generate(Completion(encode(PROMPT), TOKENS))
    return decode([t async for t in generation.tokens])


@pytest.mark.timeout(120)
def test_the_follower_serves_each_commit_refuses_a_diverged_one_and_obeys_the_operator(tmp_path: Path) -> None:
    run = tmp_path / "gpt_ddp"
    commit(run, 10)
    follower, app_weights = follower_of(run)
    served = follower.served

    async def scenario() -> None:
        await follower.look()
        assert served.step == 10 and await answer(follower) == alone(run / checkpoint_name(10))
        await asyncio.to_thread(commit, run, 20)
        await follower.look()
        assert (served.step, served.fingerprint) == (20, "gpt_ddp@20")
        assert await answer(follower) == alone(run / checkpoint_name(20))
        await asyncio.to_thread(commit, run, 30, fault="nan")
        await follower.look()
        assert served.step == 20 and "not finite" in served.refused[30]
        assert 30 in app_weights.state.refused  # no other replica tries it

        assert await follower.rollback() == {"served_step": 10, "system_fingerprint": "gpt_ddp@10",
                                             "replicas_serving": 1, "replicas": 1}
        assert await answer(follower) == alone(run / checkpoint_name(10))
        await follower.look()
        assert served.step == 10  # the run's newest (20) is passed over: committed before the rollback
        await asyncio.to_thread(commit, run, 40)
        await follower.look()
        assert served.step == 40

        with pytest.raises(OperatorRefused, match="no committed checkpoint of step 99") as refused:
            await follower.promote(99)
        assert refused.value.status == 404
        assert (await follower.promote(20))["served_step"] == 20 == served.step
        assert app_weights.state.pin.step == 20 and 20 not in served.refused

        # A second rollback goes further back, never forward to the step the first left.
        assert (await follower.rollback())["served_step"] == 40
        assert (await follower.rollback())["served_step"] == 10
        assert {20, 40} <= set(app_weights.state.refused)
        await follower.look()
        assert served.step == 10

        # A refused promotion leaves the replica following the run: a step committed before it serves.
        await asyncio.to_thread(commit, run, 50)
        with pytest.raises(OperatorRefused, match="not finite") as refused:
            await follower.promote(30)
        assert refused.value.status == 422 and served.step == 10
        await follower.look()
        assert served.step == 50

    run_closing(follower.gate.engine, scenario)


@pytest.mark.timeout(120)
def test_a_checkpoint_that_answers_a_golden_prompt_otherwise_is_refused_and_undone(tmp_path: Path) -> None:
    run = tmp_path / "gpt_ddp"
    commit(run, 10)
    expected = alone(run / checkpoint_name(10))
    follower, _ = follower_of(run, **{"follow.golden_prompts": [{"prompt": PROMPT, "max_tokens": TOKENS, "expect": expected}]})
    served = follower.served

    async def scenario() -> None:
        await asyncio.to_thread(commit, run, 20)
        await follower.look()
        assert served.step == 10 and "golden prompt" in served.refused[20]
        assert served.candidate_step is None
        assert await answer(follower) == expected
        await asyncio.to_thread(commit, run, 30, seed=10)  # step 10's weights again: they answer as expected
        await follower.look()
        assert served.step == 30 and await answer(follower) == expected

    run_closing(follower.gate.engine, scenario)


@pytest.mark.timeout(120)
def test_a_publish_of_a_launch_that_lost_the_run_is_passed_over_for_the_new_holders_checkpoint(tmp_path: Path) -> None:
    """A launch taken over (generation 1) publishes once more, at step 40, before its next lease
    look; the new holder (generation 2) commits step 20. The follower serves the new holder's
    checkpoint, never the discarded trajectory's weights, however far they got."""
    from shardyard.checkpoint.lease import RunLease
    from shardyard.checkpoint.published import Published

    run = tmp_path / "gpt_ddp"
    commit(run, 10)
    follower, app_weights = follower_of(run)
    RunLease(str(run), run.name).acquire()  # generation 1, which then loses the run
    RunLease(str(run), run.name).acquire(take_over=True)  # generation 2
    commit(run, 20)
    app_weights.put(Published(run.name, 40, read_spec(run / checkpoint_name(10)).model, [], generation=1))
    run_closing(follower.gate.engine, follower.look)
    assert follower.served.step == 20
