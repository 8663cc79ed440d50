"""Requests their clients abandon, through the whole path a client's request takes (Serve's HTTP
proxy, the replica's routes, the engine core): a stream closed mid-way and a request whose client
stopped waiting stop decoding at once and give their KV cache blocks back, and a stream beside
them goes on to its end with the tokens it gets alone."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator

import pytest
import requests

from shardyard.checkpoint.loaders import find_latest
from shardyard.localdist import free_port, run_distributed
from helpers.serving import metrics, save_default_job_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP = "abandoned"
LONG = 1500  # tokens a request left alone would decode: seconds of a tiny model's steps


@pytest.fixture(scope="module")
def long_context_app(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """README's default GPT made tiny, with a context long enough that an abandoned request would
    decode for seconds, served by the engine core on the module's own Serve instance."""
    from ray import serve

    from shardyard.serve.app.deployment import build_app

    run_dir = tmp_path_factory.mktemp("long_context")
    run_distributed(save_default_job_checkpoint, 1, str(run_dir),
                    ("model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=2048"))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"checkpoint": str(find_latest(run_dir)), "batching.max_batch_size": 4,
                         "limits": {"max_tokens_limit": 2048, "request_timeout_s": 120}}),
              name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{port}/{APP}"
    serve.shutdown()


def body(max_tokens: int, **extra) -> dict:
    return {"prompt": "def f(x):", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def streamed_text(url: str, max_tokens: int) -> str:
    """A stream read to its end: its text."""
    with requests.post(f"{url}/v1/completions", json=body(max_tokens, stream=True), stream=True, timeout=120) as answer:
        assert answer.status_code == 200, answer.text
        lines = [line[6:] for line in answer.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1])


def closed_after_three_tokens(url: str) -> None:
    """A stream whose client reads three chunks and closes the connection."""
    with requests.post(f"{url}/v1/completions", json=body(LONG, stream=True), stream=True, timeout=120) as answer:
        assert answer.status_code == 200, answer.text
        chunks = (line for line in answer.iter_lines() if line.startswith(b"data: "))
        for _ in range(3):
            next(chunks)
    # Leaving the block closes the connection mid-stream.


def timed_out_by_its_client(url: str) -> None:
    """A whole answer whose client stops waiting after a second (its connection closed)."""
    with pytest.raises(requests.ReadTimeout):
        requests.post(f"{url}/v1/completions", json=body(LONG), timeout=(30, 1.0))


def engine_numbers(url: str, until: Callable[[dict[str, float]], bool]) -> dict[str, float]:
    """The app's tokens decoded, requests running and cache blocks held at one moment (one scrape),
    once `until` holds for them. Ray's agents export every few seconds: the moment is waited for."""
    names = {"ray_shardyard_generated_tokens_total": "tokens", "ray_shardyard_running_requests": "running",
             "ray_shardyard_kv_cache_blocks_used": "blocks"}
    values = metrics(url, list(names), APP, lambda got: until({names[k]: v for k, v in got.items()}))
    return {names[k]: v for k, v in values.items()}


def test_abandoned_requests_stop_decoding_and_free_their_cache_while_a_stream_beside_them_ends_whole(
        long_context_app: str) -> None:
    url = long_context_app
    assert streamed_text(url, 8)  # the series exist once tokens were decoded
    before = engine_numbers(url, lambda n: n["tokens"] >= 8 and n["running"] == 0)["tokens"]
    beside: list[str] = []
    neighbour = threading.Thread(target=lambda: beside.append(streamed_text(url, 300)))
    neighbour.start()
    closed_after_three_tokens(url)
    timed_out_by_its_client(url)
    neighbour.join(timeout=240)
    # A moment after the neighbour's tokens with nothing running: every request of this test had
    # ended by then. Left alone, the two abandoned requests would have decoded LONG tokens each.
    after = engine_numbers(url, lambda n: n["tokens"] >= before + 300 and n["running"] == 0)
    assert after["blocks"] == 0  # every block given back (those of prefixes stay findable, unheld)
    if after["tokens"] - before >= 300 + LONG:
        # One decoded on. Ray Serve has reports of client cancellations it loses (ray-project/ray
        # #52533), which a replica never hears of; one that shardyard drops is dropped every time:
        # the two are abandoned once more, alone.
        again = after["tokens"]
        closed_after_three_tokens(url)
        timed_out_by_its_client(url)
        after = engine_numbers(url, lambda n: n["tokens"] >= again + 3 and n["running"] == 0)
        assert after["tokens"] - again < LONG, f"{after['tokens'] - again:g} tokens: an abandoned request decoded on"
    # The stream beside them got what it gets alone (greedy), and the app serves on.
    assert beside == [streamed_text(url, 300)]
