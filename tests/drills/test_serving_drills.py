"""Serving drills: one client's request must not cost the others theirs. The decoding engine in
one process, on a GPT with random weights (what it decodes does not matter, only that every
request gets what decoding it alone gives); test_serve.py runs the same engine behind HTTP."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shardyard.models import build_model
from shardyard.serve.sampling import Sampling, choose_rows
from shardyard.serve.generation import Completion, encode, generate
from shardyard.spec import GPTSpec
from helpers.engine import CachedModel, engine_for, serve_all
from helpers.drills import checkpoints


def requests() -> list[Completion]:
    """Ordinary requests, and one whose temperature (1e-45, within the API's bounds) makes
    logits / temperature overflow: sampling from the softmax of an infinity used to raise inside
    the shared step, and the engine then failed every running request with that error."""
    return [Completion(encode("def f(x):"), 6), Completion(encode("import"), 8, Sampling(temperature=0.8), seed=3),
            Completion(encode("x = 1"), 7, Sampling(temperature=1e-45), seed=5), Completion(encode("class"), 5, Sampling(temperature=0.7), seed=11)]


@pytest.mark.drill(outcome="answered", lost="nothing")
@pytest.mark.timeout(120)
def test_a_request_whose_temperature_overflows_the_arithmetic_leaves_the_others_untouched() -> None:
    torch.manual_seed(0)
    model = build_model(GPTSpec(n_layer=2, n_head=2, n_embd=32, block_size=16)).eval()
    forward = torch.no_grad()(model)
    expected = [generate(forward, [r], 16)[0] for r in requests()]
    greedy = generate(forward, [Completion(encode("x = 1"), 7)], 16)[0]
    assert expected[2] == greedy  # a vanishing temperature decodes greedily, its limit
    got = asyncio.run(serve_all(engine_for(CachedModel(model, rows=4)), requests(), join_after=2))
    assert got == expected


POISON = encode("~")[0]


class PoisonedPrompts(CachedModel):
    """The model, except that a prompt holding '~' comes out of its prefill as NaN logits (as a
    numerical fault in one request's row would)."""

    def forward(self, x: torch.Tensor, step, draws=None):
        out = super().forward(x, step)  # the last position's logits
        if x.shape[1] > 1 and bool((x == POISON).any()):  # a prompt (a prefill), not a decode step
            out = torch.full_like(out, float("nan"))
        return out if draws is None else choose_rows(out[:, -1], draws)  # picked where the logits are


@pytest.mark.drill(outcome="that request fails alone", lost="nothing")
@pytest.mark.timeout(120)
def test_a_request_that_fails_in_a_shared_step_fails_alone() -> None:
    """One request's token cannot be chosen: that request gets the error; the others running in
    the same steps get exactly their tokens (the engine used to fail them all with its error)."""
    torch.manual_seed(0)
    model = build_model(GPTSpec(n_layer=2, n_head=2, n_embd=32, block_size=16)).eval()
    forward = torch.no_grad()(model)
    mixed = requests()
    mixed.insert(1, Completion(encode("a~b"), 6))
    expected = [generate(forward, [r], 16)[0] for r in requests()]
    engine = engine_for(PoisonedPrompts(model, rows=4))

    async def each(request: Completion) -> list[int] | Exception:
        seq = engine.submit(request)
        try:
            return [token async for token in engine.tokens(seq)]
        except RuntimeError as err:
            return err

    async def all_of_them() -> list:
        return await asyncio.wait_for(asyncio.gather(*(each(r) for r in mixed)), 60)

    got = asyncio.run(all_of_them())
    assert isinstance(got[1], RuntimeError) and "NaN" in str(got[1]), got[1]
    assert got[:1] + got[2:] == expected


@pytest.mark.ray
@pytest.mark.drill(outcome="recovered", lost="nothing")
@pytest.mark.timeout(180)
def test_shards_served_from_a_run_directory_follow_it_past_pruning(ray_cluster, tmp_path) -> None:
    """Served from a run directory that training goes on writing (checkpoint.keep 1): the group
    holds the checkpoint it serves, so training keeps it; when a shard dies, the rebuilt group
    loads the run's newest committed checkpoint and releases the old one, which the next commit
    prunes. A rebuild used to reload the served checkpoint, which training had pruned, and every
    rebuild (and new replica) failed."""
    from shardyard.parallel import single_process
    from shardyard.serve.executor.shards import ShardedModel
    from shardyard.spec import parse_spec
    from shardyard.checkpoint.manager import CheckpointManager
    from shardyard.checkpoint.layout import TrainState
    from helpers.drills import job
    spec = parse_spec(job(tmp_path))
    torch.manual_seed(0)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    manager = CheckpointManager(spec.run_uri, keep=1)
    manager.save(engine, TrainState(2, 16, 1), spec)
    sharded = ShardedModel(spec.run_uri, 2, cpus_per_shard=0.5)  # beside whatever else holds a CPU
    try:
        tokens = torch.tensor([[5, 6, 7, 8]])
        with torch.no_grad():
            for p in engine.model.parameters():  # training goes on: other weights at step 4
                p.add_(0.01 * torch.randn_like(p))
        manager.save(engine, TrainState(4, 32, 1), spec)  # keep 1, but the group holds step 2
        assert checkpoints(tmp_path) == [2, 4]
        sharded.rebuild()
        assert sharded.checkpoint_dir.endswith("checkpoint_step_00000004")
        manager.save(engine, TrainState(6, 48, 1), spec)  # released by the rebuild: pruned now
        assert checkpoints(tmp_path) == [4, 6]
        with torch.no_grad():
            expected = engine.model.eval()(tokens)
        torch.testing.assert_close(sharded.forward(tokens), expected, rtol=0, atol=1e-5)
    finally:
        sharded.close()


@pytest.mark.drill(outcome="refused with a message", lost="nothing")
@pytest.mark.timeout(120)
def test_a_checkpoint_whose_vocabulary_cannot_hold_the_served_text_is_refused_at_start(tmp_path) -> None:
    """A GPT trained on synthetic ids 0-63 served as text (UTF-8 bytes up to 255): every request
    used to fail on an out-of-range embedding index (on CUDA, breaking the device for good while
    health checks passed). The server refuses to start instead, saying why."""
    from shardyard.serve.resolved import load_config
    from shardyard.spec import SpecError
    from helpers.drills import job, write_checkpoint
    small = job(tmp_path / "small", model={"vocab_size": 64})
    write_checkpoint(small)
    with pytest.raises(SpecError, match=r"vocabulary has 64 ids but the text is tokenized with UTF-8 bytes"):
        load_config({"checkpoint": str(tmp_path / "small" / "run")}, use_gpu=False)
    write_checkpoint(job(tmp_path / "bytes"))  # 256 ids: every byte has its row
    assert load_config({"checkpoint": str(tmp_path / "bytes" / "run")}, use_gpu=False).tokenizer is None


@pytest.mark.ray
@pytest.mark.drill(outcome="fails with a message", lost="nothing")
@pytest.mark.timeout(120)
def test_a_shard_group_that_finds_no_free_room_gives_up_and_leaves_no_pending_group(ray_cluster) -> None:
    """The cluster has the room, but others hold it: the shard group waits its timeout, then fails
    saying so and removes its placement group (left pending, it would take the resources whenever
    they freed up, for a group nobody uses)."""
    import ray
    from ray.util import placement_group, placement_group_table, remove_placement_group

    from shardyard.serve.executor.placement import place_shards

    node_cpus = max(node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"])
    neighbour = placement_group([{"CPU": 0.5}])  # another team's work on the node
    ray.get(neighbour.ready(), timeout=60)
    before = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
    try:
        with pytest.raises(RuntimeError, match=r"the cluster has no room for 1 shards .* after 2 s"):
            place_shards(1, {"CPU": node_cpus}, timeout_s=2)  # the whole node: fits an idle one
    finally:
        remove_placement_group(neighbour)
    left = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"} - before
    assert left == set(), placement_group_table()
