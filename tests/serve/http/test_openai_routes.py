"""The HTTP surface (serve/http/openai_routes.py, serve/http/admin_routes.py) without Ray Serve: the routes
and the guard in a FastAPI app served by uvicorn on a real socket, over the built-in engine in
this process; answers equal to the model's alone, streamed or whole, each mistake's status, the
admin routes' rights and an operator's promotion. test_serve.py runs the same routes in the Serve
app."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests

from helpers.http import served_by_uvicorn
from helpers.followed_run import PROMPT, alone, commit
from shardyard.checkpoint.record import checkpoint_name
from shardyard.serve.http.admin_routes import Admin
from shardyard.serve.http import openai_api as oa
from shardyard.serve.http.guard import GuardSettings
from shardyard.serve.http.surface import http_app
from shardyard.serve.http.openai_routes import Answering, answer
from helpers.followed_run import follower_of
TOKEN, ADMIN_TOKEN = "client-token", "operator-token"
AUTH, ADMIN = ({"Authorization": f"Bearer {token}"} for token in (TOKEN, ADMIN_TOKEN))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("routes") / "gpt_ddp"
    commit(run, 10)
    commit(run, 20)
    return run


@contextmanager
def served(answering: Answering, admin: Admin, token: str | None, admin_token: str | None = None,
           root_path: str = "", open_per_s: float = 20.0) -> Iterator[str]:
    """The routes over `answering`, behind the guard, on a real socket: their base URL."""
    guard = GuardSettings(16_384, token, admin_token=admin_token, open_per_s=open_per_s)
    with served_by_uvicorn(http_app(guard, answering, admin), root_path) as url:
        yield url


@pytest.fixture(scope="module")
def answering(run_dir: Path) -> Iterator[Answering]:
    """The run served from its newest checkpoint (20), following it."""
    follower, _ = follower_of(run_dir)
    try:
        yield Answering(follower.cfg, "gpt", 2048, 256, follower.gate.engine, follower.served,
                        lambda: "ray_serve_up 1\n")
    finally:
        follower.gate.engine.close()


@pytest.fixture(scope="module")
def app(answering: Answering) -> Iterator[str]:
    """Its routes without a token (and without an operator's: the admin routes are off)."""
    with served(answering, Admin(None), None) as url:
        yield url


def error_of(response: requests.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["message"]


@pytest.mark.timeout(120)
def test_completions_whole_or_streamed_equal_the_model_alone(app: str, run_dir: Path) -> None:
    expected = alone(run_dir / checkpoint_name(20))
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    whole = requests.post(f"{app}/v1/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["text"] == expected and whole["system_fingerprint"] == "gpt_ddp@20"
    with requests.post(f"{app}/v1/completions", json={**body, "stream": True}, stream=True, timeout=60) as r:
        events = [line.removeprefix(b"data: ") for line in r.iter_lines() if line]
    assert events[-1] == b"[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
    model: dict[str, Any] = requests.get(f"{app}/v1/models", timeout=10).json()["data"][0]
    assert (model["id"], model["served_step"], model["max_model_len"], model["served_from"]) == (
        "gpt_ddp", 20, 2048, "storage")
    assert requests.get(f"{app}/healthz", timeout=10).json() == {"status": "ok", "model": "gpt", "engine": "builtin"}
    assert requests.get(f"{app}/metrics", timeout=10).text == "ray_serve_up 1\n"


@pytest.mark.timeout(60)
def test_each_mistake_gets_its_status_and_reason(app: str) -> None:
    post = lambda route, body: requests.post(f"{app}{route}", json=body, timeout=30)  # noqa: E731
    status, reason = error_of(post("/v1/completions", {"prompt": "x", "model": "other"}))
    assert status == 404 and "'other' is not served here" in reason
    status, reason = error_of(post("/v1/completions", {"prompt": "x" * 2040, "max_tokens": 16}))
    assert status == 400 and "exceed the model's context of 2048 tokens" in reason
    assert re.search(r"at most \d+ new tokens fit after this prompt", reason), reason  # what would fit
    status, reason = error_of(post("/v1/completions", {"prompt": "x", "n": 9}))
    assert status == 400 and "at most 8" in reason
    status, reason = error_of(post("/v1/completions", {"prompt": "x", "seed": 2**64 - 1}))
    assert status == 400 and "seed" in reason  # over vLLM's range, as its own server refuses it
    last = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "seed": 2**63 - 1, "n": 2}).json()
    assert len(last["choices"]) == 2  # the second choice's seed wraps to 0
    assert post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4}).status_code == 200
    status, reason = error_of(post("/v1/predict", {"inputs": [[1.0]]}))
    assert status == 404 and "use /v1/completions" in reason
    status, reason = error_of(post("/admin/rollback", {}))
    assert status == 403 and "admin routes are off" in reason


def asgi_call(response: Any, sent: list[dict], block_after_chunks: int | None = None,
              read_every_s: float = 0.0) -> Any:
    """`response` called as Serve's ASGI server calls it: `sent` gathers what it sends; with
    `block_after_chunks`, the client stops reading once that many body chunks arrived (its send
    waits for ever, as a socket whose reader went away does until the task is cancelled)."""
    never = asyncio.Event()

    async def receive() -> dict:
        await never.wait()  # the client never says it left: Serve cancels the task instead
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        await asyncio.sleep(read_every_s)  # a client that reads one chunk every so often
        chunks = sum(m["type"] == "http.response.body" for m in sent)
        if block_after_chunks is not None and chunks >= block_after_chunks:
            await never.wait()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "method": "POST", "path": "/v1/completions",
             "headers": []}
    return response(scope, receive, send)


@pytest.mark.timeout(60)
def test_streams_give_their_choices_back_however_their_responses_end(answering: Answering) -> None:
    """Three streamed requests of 3 choices each arrive before any of their streams starts: the
    third does not fit beside the other two (the limit is 8 choices) and waits its turn. Each
    stream's choices come back when its response ends, however it ends: its ASGI task cancelled
    before the first chunk or mid-stream (Serve cancels a request's task when its client
    disconnects), timed out, never called at all, or sent whole; and a stream cut off mid-way
    stops its decoders."""
    body = oa.CompletionRequest(prompt=PROMPT, max_tokens=64, n=3, stream=True)
    prompts = [answering.prompt_tokens(PROMPT, 64)]

    async def cancelled_before_its_first_chunk(response: Any) -> None:
        sent: list[dict] = []
        task = asyncio.ensure_future(asgi_call(response, sent))
        await asyncio.sleep(0)  # the response has started and waits for its first tokens
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not any(m["type"] == "http.response.body" and m.get("body") for m in sent)

    async def ends() -> None:
        first, second = [await answer(answering, prompts, body, chat=False) for _ in range(2)]
        assert answering.choices.in_flight == 6
        third = asyncio.ensure_future(answer(answering, prompts, body, chat=False))
        await asyncio.sleep(0.05)
        assert not third.done() and answering.choices.waiting == 1  # queued behind the two

        await cancelled_before_its_first_chunk(first)
        assert answering.choices.in_flight == 6 and answering.choices.waiting == 0  # the third got its turn
        await cancelled_before_its_first_chunk(await third)
        assert answering.choices.in_flight == 3
        sent: list[dict] = []

        task = asyncio.ensure_future(asgi_call(second, sent, block_after_chunks=2))
        while sum(m["type"] == "http.response.body" for m in sent) < 2:
            await asyncio.sleep(0.01)
        task.cancel()  # mid-stream, its client no longer reading
        with pytest.raises(asyncio.CancelledError):
            await task
        assert answering.choices.in_flight == 0
        assert second.body_iterator.ag_frame is None  # closed: its decoders were abandoned

        timed_out = await answer(answering, prompts, body, chat=False)
        with pytest.raises(asyncio.TimeoutError):  # Serve's request_timeout_s, as wait_for does it
            await asyncio.wait_for(asgi_call(timed_out, [], block_after_chunks=1), 0.5)
        assert answering.choices.in_flight == 0

        await answer(answering, prompts, body, chat=False)  # returned, never called, dropped
        gc.collect()
        assert answering.choices.in_flight == 0

        whole: list[dict] = []
        await asgi_call(await answer(answering, prompts, body, chat=False), whole)
        assert whole[-1]["type"] == "http.response.body" and b"[DONE]" in b"".join(
            m.get("body", b"") for m in whole)
        assert answering.choices.in_flight == 0

    asyncio.run(ends())


@pytest.mark.timeout(120)
def test_an_operator_promotes_with_the_admin_token_and_a_client_cannot(run_dir: Path) -> None:
    follower, _ = follower_of(run_dir)
    answering = Answering(follower.cfg, "gpt", 2048, 256, follower.gate.engine, follower.served, lambda: "")
    try:
        with served(answering, Admin(follower), TOKEN, ADMIN_TOKEN) as url:
            for headers in ({}, AUTH):  # no token, or the clients'
                refused = requests.post(f"{url}/admin/promote", json={"step": 10}, headers=headers, timeout=30)
                assert error_of(refused) == (401, "missing or wrong admin token (Authorization: Bearer <admin token>)")
            assert requests.get(f"{url}/v1/models", headers=ADMIN, timeout=30).status_code == 401  # admin only
            status, reason = error_of(requests.post(f"{url}/admin/promote", json={"step": 99}, headers=ADMIN,
                                                    timeout=30))
            assert status == 404 and "no committed checkpoint of step 99" in reason
            promoted = requests.post(f"{url}/admin/promote", json={"step": 10}, headers=ADMIN, timeout=60).json()
            assert promoted["served_step"] == 10 and promoted["system_fingerprint"] == "gpt_ddp@10"
            reply = requests.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                                  json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()
            assert reply["choices"][0]["text"] == alone(run_dir / checkpoint_name(10))
    finally:
        follower.gate.engine.close()

    with served(answering, Admin(None), TOKEN, ADMIN_TOKEN) as url:
        status, reason = error_of(requests.post(f"{url}/admin/rollback", headers=ADMIN, timeout=30))
        assert status == 409 and "follow: true" in reason


@pytest.mark.timeout(60)
def test_the_admin_routes_take_the_operators_token_whatever_the_apps_root_path(
        answering: Answering, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `root_path` "/" the guard once stripped "/" from "/admin/rollback", took it for a
    client's route and let the clients' token run it. The guard now judges the route the router
    matched, and the admin routes check the operator's token themselves too."""
    for root_path in ("/api", ""):  # uvicorn puts root_path in front of the request's path, as a proxy does
        with served(answering, Admin(None), TOKEN, ADMIN_TOKEN, root_path) as url:
            refused = requests.post(f"{url}/admin/rollback", headers=AUTH, timeout=30)
            assert error_of(refused) == (401, "missing or wrong admin token (Authorization: Bearer <admin token>)")
            allowed = requests.post(f"{url}/admin/rollback", headers=ADMIN, timeout=30)
            assert error_of(allowed)[0] == 409  # the operator reaches the route (this app follows no run)
            assert requests.get(f"{url}/v1/models", headers=AUTH, timeout=30).status_code == 200

    async def root_slash(headers: dict[str, str]) -> httpx.Response:
        """The scope an ASGI server gives with root_path "/" and the path left whole."""
        app = http_app(GuardSettings(16_384, TOKEN, admin_token=ADMIN_TOKEN), answering, Admin(None))
        transport = httpx.ASGITransport(app=app, root_path="/")
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            return await client.post("/admin/rollback", headers=headers)
    assert asyncio.run(root_slash(AUTH)).status_code == 401
    assert asyncio.run(root_slash(ADMIN)).status_code == 409

    from shardyard.serve.http import guard

    monkeypatch.setattr(guard, "routed_path", lambda scope: "/v1/models")  # a guard that misreads every path
    with served(answering, Admin(None), TOKEN, ADMIN_TOKEN) as url:
        refused = requests.post(f"{url}/admin/rollback", headers=AUTH, timeout=30)
        assert error_of(refused) == (401, "missing or wrong admin token (Authorization: Bearer <admin token>)")


@pytest.mark.timeout(60)
def test_refused_steps_name_no_server_paths(answering: Answering, app: str) -> None:
    """/v1/models tells clients why a checkpoint was refused, without the server's paths."""
    run = "/srv/teams/secret-project/runs/gpt_ddp"
    answering.served.refused[30] = (f"checkpoint {run}/checkpoint_step_00000030 failed verification: "
                                    f"{run}/checkpoint_step_00000030/__0_0.distcp does not match its checksum "
                                    f"(corrupted); see s3://bucket/private/notes.txt")
    try:
        reason = requests.get(f"{app}/v1/models", timeout=10).json()["data"][0]["refused_steps"]["30"]
    finally:
        del answering.served.refused[30]
    assert reason == ("checkpoint checkpoint_step_00000030 failed verification: checkpoint_step_00000030/__0_0.distcp "
                      "does not match its checksum (corrupted); see notes.txt")


@pytest.mark.timeout(60)
def test_a_streams_latency_is_timed_to_its_last_token_not_to_the_clients_reading(run_dir: Path) -> None:
    """The canary compares the weights' latencies: a client that reads a stream slowly made the
    candidate's look as slow as it liked (a checkpoint refused for good), or the baseline's."""
    follower, _ = follower_of(run_dir)  # an engine of its own, driven from this test's event loop
    answering = Answering(follower.cfg, "gpt", 2048, 256, follower.gate.engine, follower.served, lambda: "")
    body = oa.CompletionRequest(prompt=PROMPT, max_tokens=8, stream=True)
    prompts = [answering.prompt_tokens(PROMPT, 8)]

    async def slow_reader() -> float:
        response = await answer(answering, prompts, body, chat=False)
        started = time.perf_counter()
        await asgi_call(response, [], read_every_s=0.4)
        return time.perf_counter() - started
    try:
        read_for = asyncio.run(slow_reader())
    finally:
        follower.gate.engine.close()
    ((weights, tally),) = answering.tally.items()
    assert tally.answered == 1 and read_for > 1.0 and tally.seconds < read_for / 3, (tally, read_for)


@pytest.mark.timeout(60)
def test_a_flood_of_unauthenticated_health_checks_is_bounded_and_clients_with_the_token_pass(
        answering: Answering) -> None:
    """64 clients flooding the open /healthz without a token took the CPU authenticated requests
    needed. Past a burst, unauthenticated health checks get 429; with the token they pass. (The
    bucket refills at 1 a second here, so a slow machine's 80 requests still meet the bound.)"""
    with served(answering, Admin(None), TOKEN, open_per_s=1.0) as url:
        with requests.Session() as session:
            codes = [session.get(f"{url}/healthz", timeout=10).status_code for _ in range(80)]
            assert codes[:40] == [200] * 40 and codes.count(429) >= 20, codes
            limited = session.get(f"{url}/healthz", timeout=10)
            if limited.status_code == 429:
                assert limited.headers["Retry-After"] == "1" and "without a token" in error_of(limited)[1]
            assert session.get(f"{url}/healthz", headers=AUTH, timeout=10).status_code == 200
            assert session.get(f"{url}/v1/models", headers=AUTH, timeout=10).status_code == 200
