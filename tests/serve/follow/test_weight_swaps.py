"""Swapping a served model's weights, without Ray: the golden-prompt gate (the edit distance, the
verdict, the answers decoded by a model held in this process), the swap a refused checkpoint is
undone with, and the gate that keeps a swap between static batches (the drills in
tests/drills/test_follow_drills.py swap weights in served apps)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from helpers.followed_run import PROMPT, alone, commit
from shardyard.checkpoint.reader_holds import live_holds
from shardyard.checkpoint.record import checkpoint_name
from shardyard.storage.store import RunStorage
from shardyard.serve.engine.batching import BatchGate
from shardyard.serve.generation import TextCodec
from shardyard.serve.engine.golden import GoldenPrompt, edit_distance, greedy_answers, regressions
from shardyard.serve.executor.local_model import LocalModel
from shardyard.spec import SpecError


@pytest.mark.timeout(30)
@pytest.mark.parametrize("a, b, distance", [("", "", 0), ("abc", "", 3), ("", "ab", 2), ("kitten", "sitting", 3),
                                            ("flaw", "lawn", 2), ("same", "same", 0), ("ab", "ba", 2)])
def test_edit_distance_counts_characters_inserted_deleted_or_replaced(a: str, b: str, distance: int) -> None:
    assert edit_distance(a, b) == distance == edit_distance(b, a)


@pytest.mark.timeout(30)
def test_an_answer_is_held_to_its_expect_else_to_the_served_weights_answer() -> None:
    prompts = [GoldenPrompt(prompt="p", expect="hello"), GoldenPrompt(prompt="q")]
    assert regressions(prompts, ["anything", "world"], ["hello", "world"], 0) == []
    assert regressions(prompts, ["hello", "world"], ["hellp", "world"], 1) == []
    failed = regressions(prompts, ["hello", "world"], ["hellp", "word"], 0)
    assert len(failed) == 2 and "'p'" in failed[0] and "1 edits from 'hello'" in failed[0]
    assert "'q'" in failed[1] and "from 'world'" in failed[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """README's default GPT at steps 10 and 20 (other weights)."""
    run = tmp_path_factory.mktemp("golden") / "gpt_ddp"
    commit(run, 10, overrides=())
    commit(run, 20, overrides=())
    return run


@pytest.mark.timeout(120)
def test_a_swap_is_undone_by_swapping_back_and_the_other_weights_let_go(run_dir: Path) -> None:
    """LocalModel keeps the served weights beside the new ones until the gate has judged them: a
    swap back serves the old ones again, and dropping the others lets their checkpoint's hold go
    (training may prune it again)."""
    first, second = run_dir / checkpoint_name(10), run_dir / checkpoint_name(20)
    golden = [GoldenPrompt(prompt=PROMPT, max_tokens=12)]
    model = LocalModel(str(first))

    def answer() -> str:
        return greedy_answers(model.forward, golden, TextCodec(), model.block_size, None)[0]

    storage = RunStorage(run_dir)
    try:
        assert answer() == alone(first)
        assert model.prepare(str(second)) and live_holds(storage, second.name)
        with model.exclusive():
            model.swap()
            assert answer() == alone(second) != alone(first)
            assert model.checkpoint_dir == str(second)
            model.swap_back()
            model.drop_staged()
        assert answer() == alone(first) and model.checkpoint_dir == str(first)
        assert not live_holds(storage, second.name) and live_holds(storage, first.name)
    finally:
        model.close()
    assert not live_holds(storage, first.name)


@pytest.mark.timeout(60)
def test_golden_prompts_are_checked_when_the_config_is_read(run_dir: Path) -> None:
    from shardyard.serve.resolved import load_config

    def read(args: dict) -> object:
        return load_config({"checkpoint": str(run_dir), **args}, use_gpu=False)

    with pytest.raises(SpecError, match="follow.enabled"):
        read({"follow": False, "follow.golden_prompts": [{"prompt": "x"}]})
    with pytest.raises(SpecError, match="give checkpoint a run directory"):
        read({"checkpoint": str(run_dir / checkpoint_name(10)), "follow.golden_prompts": [{"prompt": "x"}]})
    with pytest.raises(SpecError, match=r"golden_prompts\[1\].*context of 64 tokens"):
        read({"follow.golden_prompts": [{"prompt": "x"}, {"prompt": "y" * 60}]})
    with pytest.raises(SpecError, match="follow.golden_prompts.0.answer"):
        read({"follow.golden_prompts": [{"prompt": "x", "answer": "y"}]})
    config = read({"follow.golden_prompts": [{"prompt": "x", "expect": "y"}]})
    assert config.follow.golden_prompts[0].max_tokens == 16 and config.following


@pytest.mark.timeout(30)
def test_a_swap_waits_for_running_batches_and_batches_formed_meanwhile_wait_for_it() -> None:
    events: list[str] = []

    async def batch(gate: BatchGate, name: str, started: asyncio.Event | None = None) -> None:
        async with gate.shared():
            events.append(f"{name} starts")
            if started is not None:
                started.set()
            await asyncio.sleep(0.05)
            events.append(f"{name} ends")

    async def swap(gate: BatchGate) -> None:
        async with gate.exclusive():
            events.append("swap")
            await asyncio.sleep(0.05)
            events.append("swapped")

    async def scenario() -> None:
        gate, started = BatchGate(), asyncio.Event()
        first = asyncio.create_task(batch(gate, "a", started))
        await started.wait()
        swapping = asyncio.create_task(swap(gate))
        await asyncio.sleep(0.01)
        later = asyncio.create_task(batch(gate, "b"))  # formed while the swap waits
        await asyncio.gather(first, swapping, later)

    asyncio.run(scenario())
    assert events == ["a starts", "a ends", "swap", "swapped", "b starts", "b ends"]
