"""HTTP drills: what a hostile or careless client sends, and what the app's guard (serve/http/guard.py)
must answer. The guard in front of a small FastAPI app served by uvicorn on a real socket, without
Ray (test_serve.py runs the same guard in the Serve app): auth before the body is read, body
limits before and while reading, one JSON error shape for every error, unhandled ones included,
each counted by route template."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from fastapi import FastAPI, Request

from helpers.http import private_file, served_by_uvicorn, trickled_bodies
from shardyard.serve.http.openai_routes import PredictRequest
from shardyard.serve.http.guard import GuardSettings, install
from shardyard.spec import SpecError

TOKEN = "s3cret-token-of-the-drills"
LIMIT = 1024
BODY_TIMEOUT_S = 2.0
PENDING_BODIES = 50


class App:
    """The guarded app, what its routes saw and what the guard counted."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.errors: list[tuple[int, str]] = []
        self.api = FastAPI()
        install(self.api, GuardSettings(LIMIT, TOKEN, BODY_TIMEOUT_S, lambda status, route: self.errors.append((status, route)),
                                        max_pending_bodies=PENDING_BODIES))

        @self.api.post("/v1/echo")
        async def echo(request: Request) -> dict:
            self.bodies.append(await request.body())
            return {"bytes": len(self.bodies[-1])}

        @self.api.get("/v1/items/{item}")
        async def boom(item: str) -> dict:
            raise KeyError(item)  # a bug in a route: must still leave as the JSON error shape

        @self.api.post("/v1/predict")
        async def predict(body: PredictRequest) -> dict:  # the app's own request model
            return {"rows": len(body.inputs)}

        @self.api.get("/healthz")
        async def healthz() -> dict:
            return {"status": "ok"}


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[App, str]]:
    app = App()
    with served_by_uvicorn(app.api) as url:
        yield app, url


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def read_answer(sock: socket.socket) -> bytes:
    """An HTTP answer with a JSON body, read off a raw socket."""
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        answer += chunk
    return answer


def head_only(url: str, headers: dict[str, str]) -> tuple[int, dict]:
    """Send a POST's head, declaring a body that never comes, and read the answer: a guard that
    reads the body first would wait for it (and the socket's timeout would fail the drill)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST /v1/echo HTTP/1.1\r\nHost: {host}\r\n{head}\r\n".encode())
        answer = read_answer(sock)
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


def assert_error_shape(body: dict, status_type: str) -> str:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == status_type
    return body["error"]["message"]


@pytest.mark.drill(outcome="401 before the body is read", lost="nothing")
@pytest.mark.timeout(60)
def test_a_request_without_the_token_is_refused_before_its_body_is_read(app) -> None:
    app, url = app
    status, body = head_only(url, {"Content-Length": str(10**9), "Content-Type": "application/json"})
    assert status == 401 and "bearer token" in assert_error_shape(body, "authentication_error")
    near = requests.post(f"{url}/v1/echo", data=b"{}", headers={"Authorization": f"Bearer {TOKEN[:-1]}"})
    assert near.status_code == 401  # compared whole, not by prefix
    missing_route = requests.get(f"{url}/no/such/route")
    assert missing_route.status_code == 401  # auth comes before routing too
    admin = requests.post(f"{url}/admin/rollback", headers=AUTH)  # the clients' token opens no admin route
    assert admin.status_code == 403 and "admin routes are off" in assert_error_shape(admin.json(), "permission_error")
    assert requests.get(f"{url}/healthz").status_code == 200  # open for load balancers
    assert app.bodies == []


@pytest.mark.drill(outcome="413 before or while reading", lost="nothing")
@pytest.mark.timeout(60)
def test_a_body_over_the_limit_is_refused_declared_or_chunked(app) -> None:
    app, url = app
    status, body = head_only(url, {**AUTH, "Content-Length": str(10**9)})
    assert status == 413 and f"the limit is {LIMIT}" in assert_error_shape(body, "invalid_request_error")

    def chunks():  # no Content-Length: requests sends Transfer-Encoding: chunked
        for _ in range(64):
            yield b"x" * 512

    chunked = requests.post(f"{url}/v1/echo", data=chunks(), headers=AUTH, timeout=30)
    assert chunked.status_code == 413 and f"over {LIMIT} bytes" in chunked.json()["error"]["message"]
    assert requests.post(f"{url}/v1/echo", data=b"x" * LIMIT, headers=AUTH).json() == {"bytes": LIMIT}
    small_chunks = requests.post(f"{url}/v1/echo", data=iter([b"ab", b"cd"]), headers=AUTH)
    assert small_chunks.json() == {"bytes": 4}  # a chunked body within the limit reaches the route whole
    assert app.bodies == [b"x" * LIMIT, b"abcd"]


@pytest.mark.drill(outcome="one JSON error shape, counted by route", lost="nothing")
@pytest.mark.timeout(60)
def test_every_error_leaves_in_one_json_shape_and_is_counted_by_route_template(app) -> None:
    app, url = app
    app.errors.clear()
    not_found = requests.get(f"{url}/no/such/path-x7q", headers=AUTH)
    assert not_found.status_code == 404 and "/no/such/path-x7q" in assert_error_shape(not_found.json(), "not_found_error")
    wrong_method = requests.get(f"{url}/v1/echo", headers=AUTH)
    assert wrong_method.status_code == 405
    assert "GET is not allowed" in assert_error_shape(wrong_method.json(), "invalid_request_error")
    crashed = requests.get(f"{url}/v1/items/q93", headers=AUTH)
    assert crashed.status_code == 500 and crashed.headers["content-type"] == "application/json"
    assert "internal server error" in assert_error_shape(crashed.json(), "server_error")
    assert "q93" not in crashed.text  # no internals leak to the client
    json_body = {**AUTH, "Content-Type": "application/json"}
    malformed = requests.post(f"{url}/v1/predict", data="{not json", headers=json_body)
    assert malformed.status_code == 400 and "not valid JSON" in assert_error_shape(malformed.json(), "invalid_request_error")
    not_finite = requests.post(f"{url}/v1/predict", data='{"inputs": [[1.0, NaN, Infinity]]}', headers=json_body)
    assert not_finite.status_code == 400 and not_finite.json()["error"]["param"].startswith("inputs")
    # Labels come from the routes' templates: a client's random paths add no label.
    assert app.errors == [(404, "unmatched"), (405, "/v1/echo"), (500, "/v1/items/{item}"), (400, "/v1/predict"),
                          (400, "/v1/predict")]
    assert requests.post(f"{url}/v1/echo", data=b"{}", headers=AUTH).status_code == 200  # still serving


@pytest.mark.drill(outcome="refused with a message", lost="nothing")
@pytest.mark.timeout(60)
def test_the_bearer_token_never_travels_in_deployment_arguments_and_is_never_empty(tmp_path: Path, monkeypatch) -> None:
    """Serve's dashboard shows deployment arguments: the tokens (the clients' and the operator's)
    are read from a variable or a file where the config is parsed; an empty one would let every
    request in, and an operator's token that is the clients' too would make every client an
    operator, so both are refused."""
    from shardyard.serve.config import parse_config
    from shardyard.serve.resolved import load_config, read_token

    for name in ("bearer_token", "admin_token"):
        with pytest.raises(SpecError, match=f"{name}: deployment arguments are shown by Serve's dashboard"):
            parse_config({name: TOKEN})
        with pytest.raises(SpecError, match=f"{name}: deployment arguments are shown by Serve's dashboard"):
            parse_config({f"auth.{name}": TOKEN})
    from helpers.drills import job, write_checkpoint
    write_checkpoint(job(tmp_path))
    private_file(tmp_path / "token", TOKEN + "\n")
    cfg = load_config({"checkpoint": str(tmp_path / "run"), "auth.bearer_token_file": str(tmp_path / "token")},
                      use_gpu=False)
    assert cfg.bearer_token == TOKEN and TOKEN not in json.dumps(cfg.arguments())  # what Serve is given
    assert cfg.admin_token is None  # the admin routes are off unless an operator's token is given
    monkeypatch.setenv("SHARDYARD_TEST_TOKEN", f" {TOKEN}\n")
    assert read_token("SHARDYARD_TEST_TOKEN", None, "bearer_token") == TOKEN
    assert read_token(None, str(tmp_path / "token"), "bearer_token") == TOKEN
    with pytest.raises(SpecError, match="auth.admin_token: it is the clients' bearer token too"):
        load_config({"checkpoint": str(tmp_path / "run"), "auth": {"bearer_token_file": str(tmp_path / "token"),
                     "admin_token_env": "SHARDYARD_TEST_TOKEN"}}, use_gpu=False)
    monkeypatch.setenv("SHARDYARD_EMPTY_TOKEN", "  ")
    with pytest.raises(ValueError, match="admin_token: the environment variable SHARDYARD_EMPTY_TOKEN is empty"):
        read_token("SHARDYARD_EMPTY_TOKEN", None, "admin_token")
    with pytest.raises(ValueError, match="bearer_token_env: the environment variable SHARDYARD_NO_SUCH_VARIABLE"):
        read_token("SHARDYARD_NO_SUCH_VARIABLE", None, "bearer_token")
    with pytest.raises(ValueError, match="cannot read"):
        read_token(None, str(tmp_path / "missing"), "bearer_token")
    for mode in (0o644, 0o640, 0o604, 0o620):  # readable or writable by the group or by everyone
        (tmp_path / "token").chmod(mode)
        with pytest.raises(ValueError, match=f"can be read or written by other users \\(mode {mode:03o}\\); "
                                             f"make it private: chmod 600"):
            read_token(None, str(tmp_path / "token"), "admin_token")
    (tmp_path / "token").chmod(0o400)
    assert read_token(None, str(tmp_path / "token"), "bearer_token") == TOKEN
    private_file(tmp_path / "short", "x\n")
    monkeypatch.setenv("SHARDYARD_SHORT_TOKEN", "fifteen-chars..")
    for env, file in ((None, str(tmp_path / "short")), ("SHARDYARD_SHORT_TOKEN", None)):
        with pytest.raises(ValueError, match="a token needs at least 16"):
            read_token(env, file, "admin_token")


@pytest.mark.drill(outcome="408 for the oldest bodies past the bound and after the body deadline; "
                           "others served meanwhile", lost="nothing")
@pytest.mark.timeout(60)
def test_bodies_trickled_by_many_clients_get_408_and_never_hold_an_ordinary_requests_place(app) -> None:
    """200 connections each send a head and one byte of a declared 1 KB body, then nothing, with
    50 bodies let arrive at once: each connection past the 50 ends the oldest one's wait (408), the
    last 50 get 408 once the body deadline passes, and an ordinary request sent meanwhile is served
    at once: it takes the oldest trickler's place, not the other way round."""
    app, url = app
    with trickled_bodies(url, "/v1/echo", TOKEN, 200, LIMIT) as slow:
        started = time.monotonic()
        assert requests.post(f"{url}/v1/echo", data=b"{}", headers=AUTH, timeout=10).json() == {"bytes": 2}
        answers = [read_answer(sock) for sock in slow]
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers[0]
        displaced = [a for a in answers if b"newer requests were sending theirs" in a]
        assert len(displaced) == 200 + 1 - PENDING_BODIES, len(displaced)
        assert sum(b"not received within" in a for a in answers) == PENDING_BODIES - 1
        assert time.monotonic() - started < BODY_TIMEOUT_S + 20
        assert b"{" not in app.bodies  # no trickled body reached the route


@pytest.mark.timeout(30)
def test_a_replicas_limit_counts_choices_and_queues_requests_in_order() -> None:
    """The engine's slots, counted in choices: a request that does not fit waits its turn in
    order (never overtaken by a smaller one that would fit), among at most `max_waiting`, for
    `max_wait_s` at most; a request cancelled while waiting, or just as its turn came, leaks
    nothing."""
    from shardyard.serve.http.guard import ChoiceLimit, ClientError

    async def drill() -> None:
        limit = ChoiceLimit(8, max_waiting=2, max_wait_s=0.3)
        whole = await limit.take(8)  # an idle replica takes a request up to its limit
        five = asyncio.ensure_future(limit.take(5))
        one = asyncio.ensure_future(limit.take(1))
        await asyncio.sleep(0.01)
        assert limit.waiting == 2 and not five.done() and not one.done()
        with pytest.raises(ClientError) as busy:
            await limit.take(1)
        assert busy.value.status == 503 and busy.value.retry_after_s == 1
        assert "8 choices in flight" in busy.value.reason and "2 requests wait already" in busy.value.reason
        whole.give_back()
        whole.give_back()  # a second path ending the same request returns nothing more
        taken_five, taken_one = await five, await one
        assert limit.in_flight == 6
        three = asyncio.ensure_future(limit.take(3))  # 6 + 3 > 8: waits
        two = asyncio.ensure_future(limit.take(2))  # would fit, but comes after the three
        await asyncio.sleep(0.01)
        assert not two.done()
        three.cancel()  # its client left while it waited: the two behind it gets in
        await asyncio.sleep(0.01)
        assert two.done() and limit.in_flight == 8 and limit.waiting == 0
        with pytest.raises(ClientError) as waited:
            await limit.take(1)  # nobody gives back within max_wait_s
        assert "waited 0.3 s" in waited.value.reason and limit.waiting == 0
        late = asyncio.ensure_future(limit.take(5))
        await asyncio.sleep(0.01)
        taken_five.give_back()  # its turn comes ...
        late.cancel()  # ... and its client leaves before it runs: the share goes straight back
        with pytest.raises(asyncio.CancelledError):
            await late
        for held in (taken_one, two.result()):
            held.give_back()
        assert limit.in_flight == 0 and limit.waiting == 0

    asyncio.run(drill())
