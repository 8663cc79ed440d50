"""The built-in engine as an engine backend (serve/engine/builtin.py), without Ray or Serve: what
the routes and the weight gate ask of it (generate; stage, the drained window, swap, golden
answers, swap back) over a model decoded in this process, by the continuous-batching engine and
by static batches."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from helpers.followed_run import PROMPT, alone, commit
from shardyard.checkpoint.layout import read_spec
from shardyard.checkpoint.reader_holds import live_holds
from shardyard.checkpoint.record import checkpoint_name
from shardyard.storage.store import RunStorage
from shardyard.serve.engine.backend import EngineBackend, WeightsRefused
from shardyard.serve.engine.builtin import BuiltinEngine, model_threads
from shardyard.serve.resolved import load_config
from shardyard.serve.generation import Completion, decode, encode
from shardyard.serve.engine.golden import GoldenPrompt
from shardyard.serve.engine.metrics import ServingMetrics
from shardyard.serve.engine.static_batches import Ticket
from helpers.engine import run_closing

TOKENS = 12


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run's checkpoints of steps 10 and 20 (other weights), and a diverged one of step 5."""
    run = tmp_path_factory.mktemp("builtin") / "gpt_ddp"
    commit(run, 10)
    commit(run, 20)
    commit(run, 5, fault="nan")
    return run


def started(run_dir: Path, step: int, **args: object) -> BuiltinEngine:
    cfg = load_config({"checkpoint": str(run_dir / checkpoint_name(step)), "engine.device": "cpu",
                       "batching.max_batch_size": 4, **args}, use_gpu=False)
    return BuiltinEngine(cfg, cfg.checkpoint, read_spec(cfg.checkpoint).model, cfg.fingerprint, metrics=ServingMetrics())


async def answer(engine: EngineBackend) -> tuple[str, str]:
    """PROMPT's greedy answer from `engine`, and the fingerprint of the weights that decoded it."""
    generation = engine.generate(Completion(encode(PROMPT), TOKENS))
    return decode([t async for t in generation.tokens]), generation.weights()


@pytest.mark.timeout(60)
def test_one_shard_decodes_one_row_on_its_own_cpus_and_the_rest_on_the_replicas_too(run_dir: Path) -> None:
    """The team: the replica's half CPU and the shard's, rounded up (README's 2-core default: 2
    threads); a one-row decode step on the shard's own (1). `engine.cpu_threads` sets both."""
    def threads(**settings: object) -> tuple[int, int]:
        return model_threads(load_config({"checkpoint": str(run_dir / checkpoint_name(10)), **settings}, use_gpu=False))

    assert threads() == (2, 1)
    assert threads(**{"engine.cpus_per_shard": 0.5}) == (1, 1)
    assert threads(**{"engine.cpus_per_shard": 2.5}) == (3, 2)
    assert threads(**{"engine.cpu_threads": 2}) == (2, 2)
    before = torch.get_num_threads()
    try:
        engine = started(run_dir, 10)
        assert torch.get_num_threads() == 2
        ran = []
        threads_of = engine.model.step_threads
        entered = threads_of.enter
        threads_of.enter = lambda tokens: (entered(tokens), ran.append((tuple(tokens.shape), torch.get_num_threads())))
        assert run_closing(engine, lambda: answer(engine)) == (alone(run_dir / checkpoint_name(10)), "gpt_ddp@10")
        prompt, *steps = ran
        assert prompt[0][1] > 1 and prompt[1] == 2, ran  # the prompt's pass on the team
        assert steps and all(shape == (1, 1) and count == 1 for shape, count in steps), ran
        fixed = started(run_dir, 10, **{"engine.cpu_threads": 2})
        try:
            assert fixed.model.step_threads is None  # one count: no switching
        finally:
            fixed.close()
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(120)
def test_a_request_that_arrives_during_a_swap_waits_and_decodes_on_the_new_weights(run_dir: Path) -> None:
    first, second = run_dir / checkpoint_name(10), run_dir / checkpoint_name(20)
    engine = started(run_dir, 10)
    golden = [GoldenPrompt(prompt=PROMPT, max_tokens=TOKENS)]

    async def scenario() -> None:
        assert await answer(engine) == (alone(first), "gpt_ddp@10")
        await engine.stage(str(second))
        async with engine.drained():
            waiting = asyncio.create_task(answer(engine))  # arrives while the window is open
            await asyncio.sleep(0.3)
            assert not waiting.done()
            assert await engine.golden_answers(golden) == [alone(first)]
            await engine.swap()
            assert await engine.golden_answers(golden) == [alone(second)]
            engine.weights = "gpt_ddp@20"
        assert await waiting == (alone(second), "gpt_ddp@20")

    run_closing(engine, scenario)


@pytest.mark.timeout(120)
def test_a_swap_undone_in_its_window_leaves_the_served_weights_and_lets_the_others_go(run_dir: Path) -> None:
    first, second, diverged = (run_dir / checkpoint_name(step) for step in (10, 20, 5))
    storage = RunStorage(run_dir)
    engine = started(run_dir, 10)

    async def scenario() -> None:
        await engine.stage(str(second))
        assert live_holds(storage, second.name)
        async with engine.drained():
            await engine.swap()
            await engine.swap_back()
        assert not live_holds(storage, second.name) and live_holds(storage, first.name)
        assert await answer(engine) == (alone(first), "gpt_ddp@10")
        with pytest.raises(WeightsRefused, match="not finite"):
            await engine.stage(str(diverged))
        assert not live_holds(storage, diverged.name)
        probes, healthy = [], engine.model.healthy
        engine.model.healthy = lambda *args: probes.append(1) or healthy(*args)  # counted, still probing
        assert all(await asyncio.gather(*(engine.health() for _ in range(20))))
        assert len(probes) == 1  # /healthz is open to anyone: one probe answers them all for a while

    run_closing(engine, scenario)


@pytest.mark.timeout(120)
def test_a_static_batch_decodes_each_request_as_alone_and_drops_the_abandoned(run_dir: Path) -> None:
    engine = started(run_dir, 20, batching="fixed")
    assert engine.batches is not None and engine.engine is None and not engine.bounded
    tickets = [Ticket(Completion(encode(PROMPT), TOKENS), 0.0) for _ in range(3)]
    tickets[2].abandoned = True  # its caller left before the batch ran

    async def scenario() -> list[list[object]]:
        return [step async for step in engine.batches.decode_batch(tickets)]

    steps = run_closing(engine, scenario)
    assert len(steps) == TOKENS and all(step[2] is StopIteration for step in steps)
    assert decode(tickets[0].request.tokens) == decode(tickets[1].request.tokens) == alone(run_dir / checkpoint_name(20))
    assert tickets[0].weights == "gpt_ddp@20"
