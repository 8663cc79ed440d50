"""What every HTTP request meets before the app's routes see it, and how every error leaves.

- Auth first: a request without the bearer token is refused (401) before its body is read, the
  token compared in constant time. `GET /healthz` stays open for load balancers, at a bounded
  rate without a token (429 past it); `/metrics` needs the token like everything else (Prometheus sends one with `authorization: credentials_file`).
  The admin routes (`/admin/...`) take the operator's token alone, never the clients': 403 where
  the app has none (they are off), 401 for any other token.
- Then size and time: a Content-Length over the limit is refused (413) before the body is read,
  a body sent in chunks (no Content-Length) is read only up to the limit, and a body not received
  whole within the deadline gets 408. Bodies still arriving are bounded apart from the engine's
  slots: Serve's request slots outnumber what the engine takes, and once `max_pending_bodies`
  bodies are arriving at once a new request ends the oldest one's wait (408). So clients that
  trickle bodies (slowloris) never hold the slot an ordinary request needs: the engine's slots
  (ChoiceLimit) are taken only once a body is whole.
- Every error, whichever layer makes it (a route's ClientError, FastAPI's parsing, Starlette's 404
  and 405, an unhandled exception), leaves in OpenAI's error shape and is counted by status and
  route template: never by the raw path, which a client chooses, so random paths add no series.

The guard is plain ASGI middleware: Starlette's `@app.middleware("http")` kind reads the whole
body before a limit could apply.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from shardyard.serve.http.openai_api import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

OPEN_PATHS = ("/healthz",)  # GET without a token
ADMIN_PREFIX = "/admin/"  # the operator's routes: the admin token only
UNMATCHED = "unmatched"  # the route label of a request that matched no route


class ClientError(Exception):
    """A request the app refuses: its status, the reason, and the field at fault."""

    def __init__(self, status: int, reason: str, field: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.field, self.code = status, reason, field, code
        self.retry_after_s = retry_after_s


@dataclass
class GuardSettings:
    max_body_bytes: int
    token: str | None = None  # None: no auth
    body_timeout_s: float = 10.0
    count_error: Callable[[int, str], None] = lambda status, route: None
    on_request: Callable[[], None] = lambda: None  # e.g. start the replica's metrics publisher
    admin_token: str | None = None  # None: the admin routes are off
    # The open routes (GET /healthz without a token): requests a second, and the burst allowed. A
    # load balancer asks a few times a second at most; a flood beyond gets 429 before it costs
    # the replica's CPU that authenticated requests need.
    open_per_s: float = 20.0
    open_burst: int = 40
    max_pending_bodies: int = 256  # requests sending their bodies at once; beyond, the oldest gets 408
    pending_bodies: PendingBodies = field(init=False, repr=False)
    _expected: dict[str, bytes] = field(init=False, repr=False)  # each token's header, made once
    _open_bucket: tuple[float, float] = field(init=False, repr=False)  # (tokens left, when counted)

    def __post_init__(self) -> None:
        self._expected = {t: f"Bearer {t}".encode() for t in (self.token, self.admin_token) if t is not None}
        self._open_bucket = (float(self.open_burst), time.monotonic())
        self.pending_bodies = PendingBodies(self.max_pending_bodies)

    def take_open(self) -> bool:
        """Count one unauthenticated request to an open route: False once the bucket is empty."""
        tokens, then = self._open_bucket
        now = time.monotonic()
        tokens = min(float(self.open_burst), tokens + (now - then) * self.open_per_s)
        if tokens < 1.0:
            self._open_bucket = (tokens, now)
            return False
        self._open_bucket = (tokens - 1.0, now)
        return True

    def operator_refusal(self, scope: Scope) -> tuple[int, str] | None:
        """Why an admin route refuses this request (status, reason), or None: it carries the
        operator's token."""
        if self.admin_token is None:
            return 403, "the admin routes are off: the app needs an operator's token (admin_token_env or admin_token_file)"
        if not self.authorized(scope, self.admin_token):
            return 401, "missing or wrong admin token (Authorization: Bearer <admin token>)"
        return None

    def authorized(self, scope: Scope, token: str | None) -> bool:
        if token is None:
            return True
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected[token])  # constant time: no prefix oracle


class ChoiceLimit:
    """A replica's concurrency counted in choices (prompts times n), not HTTP requests as Serve
    counts them: one request carrying many prompts would otherwise take the replica from everyone
    else. A request is let in while the replica is idle, or while its choices fit beside those in
    flight; else it waits its turn (first come, first served) among at most `max_waiting`, for
    `max_wait_s` at most. Past either it gets 503 with Retry-After, as Serve's own queue answers.
    The queue is here, after the guard has the body, and not in Serve's: Serve counts a request
    against its limit from its first byte, so there a client that never finishes its body would
    hold a slot that the engine's requests need."""

    def __init__(self, limit: int, max_waiting: int = 0, max_wait_s: float = 30.0) -> None:
        self.limit, self.in_flight = limit, 0
        self.max_waiting, self.max_wait_s = max_waiting, max_wait_s
        self._waiting: deque[tuple[int, asyncio.Future[Held]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _fits(self, choices: int) -> bool:
        return not self.in_flight or self.in_flight + choices <= self.limit

    async def take(self, choices: int) -> Held:
        """Count a request's choices in once they fit, or refuse it (503); what is taken is given
        back once through the returned `Held`, however the request ends."""
        if not self._waiting and self._fits(choices):
            return self._hold(choices)
        if len(self._waiting) >= self.max_waiting:
            raise ClientError(503, f"busy: {self.in_flight} choices in flight and this request adds {choices}; "
                                   f"the limit is {self.limit}, and {len(self._waiting)} requests wait already",
                              retry_after_s=1)
        entry = (choices, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await asyncio.wait((entry[1],), timeout=self.max_wait_s)
        except BaseException:  # cancelled (its client left) while waiting or just as its turn came
            self._withdraw(entry)
            raise
        if not entry[1].done():
            self._withdraw(entry)
            raise ClientError(503, f"busy: waited {self.max_wait_s:g} s for room for {choices} choices; "
                                   f"the limit is {self.limit}", retry_after_s=1)
        return entry[1].result()

    def _hold(self, choices: int) -> Held:
        self.in_flight += choices
        return Held(self, choices)

    def _withdraw(self, entry: tuple[int, asyncio.Future[Held]]) -> None:
        if entry[1].done():  # its turn had come: give the share straight back
            entry[1].result().give_back()
        else:
            self._waiting.remove(entry)
            entry[1].cancel()
            self._let_in()  # it may have been the head that did not fit

    def _let_in(self) -> None:
        """Hand turns to the waiting requests, in order, while the head fits."""
        while self._waiting and self._fits(self._waiting[0][0]):
            choices, turn = self._waiting.popleft()
            turn.set_result(self._hold(choices))

    def _give_back(self, choices: int) -> None:
        self.in_flight -= choices
        self._let_in()


class Held:
    """One request's share of a ChoiceLimit. `give_back` may be called from every place a request
    can end (its answer, its stream's end, a cancelled ASGI task, the response never being sent):
    only the first call counts, so no path leaks the share and none returns it twice."""

    def __init__(self, limit: ChoiceLimit, choices: int) -> None:
        self._limit, self.choices = limit, choices
        self._loop = asyncio.get_running_loop()  # the limit's: its waiting turns are futures of it

    def give_back(self) -> None:
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # no loop in this thread: a finalizer run by the garbage collector
            here = False
        if not here:  # the limit and its waiting turns are the loop's to change
            try:
                self._loop.call_soon_threadsafe(self.give_back)
            except RuntimeError:  # the loop is closed: the replica is gone, and its limit with it
                pass
            return
        if self._limit is not None:
            limit, self._limit = self._limit, None
            limit._give_back(self.choices)


class PendingBody:
    """One request whose body is arriving: the receive it waits on, and whether a newer request
    took its place."""

    def __init__(self) -> None:
        self.receiving: asyncio.Future[Message] | None = None
        self.displaced = False


class PendingBodies:
    """The requests whose bodies are arriving, oldest first, `limit` at most: one more ends the
    oldest's wait. A client trickling bodies over many connections thus takes back its own oldest
    place, never an ordinary request's, whose body is whole within milliseconds of its head."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._arriving: dict[PendingBody, None] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._arriving)

    def enter(self) -> PendingBody:
        while len(self._arriving) >= self.limit:
            oldest = next(iter(self._arriving))
            del self._arriving[oldest]
            oldest.displaced = True
            if oldest.receiving is not None:
                oldest.receiving.cancel()
        body = PendingBody()
        self._arriving[body] = None
        return body

    def leave(self, body: PendingBody) -> None:
        self._arriving.pop(body, None)


def error_response(status: int, reason: str, field: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, reason, field, code), status_code=status)


def routed_path(scope: Scope) -> str:
    """The path the app's router matches: `root_path` is stripped only where it ends at a "/"
    boundary of the path (Starlette's rule; a bare removeprefix made "/admin/x" under root_path
    "/" into "admin/x", which the guard took for a client's route while the router ran the admin
    route)."""
    path, root = scope["path"], scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    rest = path[len(root):]
    return rest if rest == "" or rest.startswith("/") else path


def route_label(scope: Scope) -> str:
    """The template of the route the request matched (Starlette records it in the scope)."""
    route = scope.get("route")
    return getattr(route, "path", UNMATCHED)


class RequestGuard:
    """ASGI middleware; its settings are the app's `state.guard`, set when the replica starts."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings: GuardSettings = scope["app"].state.guard
        settings.on_request()

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                settings.count_error(message["status"], route_label(scope))
            await send(message)

        try:
            refusal, receive = await self._admit(scope, receive, settings)
            if refusal is not None:
                await refusal(scope, receive, counted)
            elif receive is not None:  # None: the client left while sending its body
                await self.app(scope, receive, counted)
        except Exception:
            settings.count_error(500, route_label(scope))
            raise  # Starlette's outermost middleware answers it with the app's handler (below)

    async def _admit(self, scope: Scope, receive: Receive,
                     settings: GuardSettings) -> tuple[JSONResponse | None, Receive | None]:
        """A refusal, or a receive that replays the body read within the limit."""
        path = routed_path(scope)
        if path.startswith(ADMIN_PREFIX):
            refusal = settings.operator_refusal(scope)
            if refusal is not None:
                return error_response(*refusal, code="invalid_api_key" if refusal[0] == 401 else None), receive
        elif not settings.authorized(scope, settings.token):
            if not (scope["method"] == "GET" and path in OPEN_PATHS):
                return error_response(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                                      code="invalid_api_key"), receive
            if not settings.take_open():
                refusal = error_response(429, f"over {settings.open_per_s:g} requests a second to {path} without a "
                                              f"token; send the bearer token to be let through")
                refusal.headers["Retry-After"] = "1"
                return refusal, receive
        limit = settings.max_body_bytes
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if declared is not None and int(declared) > limit:  # the HTTP server has checked it is a number
            return error_response(413, f"request body is {int(declared)} bytes; the limit is {limit}"), receive
        pending = settings.pending_bodies.enter()
        try:
            refusal, body = await self._read_body(receive, settings, pending)
        finally:
            settings.pending_bodies.leave(pending)
        if refusal is not None:
            return refusal, receive
        if body is None:  # the client left
            return None, None
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:  # after the body, what the server says next (a disconnect)
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return None, replay

    @staticmethod
    async def _read_body(receive: Receive, settings: GuardSettings,
                         pending: PendingBody) -> tuple[JSONResponse | None, bytes | None]:
        """The whole body (None: the client left), or why it is refused."""
        limit, timeout_s = settings.max_body_bytes, settings.body_timeout_s
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + timeout_s
        def displaced() -> JSONResponse:
            return error_response(408, f"the request body was not received whole while "
                                       f"{settings.max_pending_bodies} newer requests were sending theirs",
                                  code="body_timeout")

        while more:
            if pending.displaced:  # displaced between two of its chunks
                return displaced(), None
            pending.receiving = asyncio.ensure_future(receive())
            try:
                message = await asyncio.wait_for(pending.receiving, deadline - time.monotonic())
            except asyncio.TimeoutError:
                return error_response(408, f"the request body was not received within {timeout_s:g} s",
                                      code="body_timeout"), None
            except asyncio.CancelledError:
                if not pending.displaced or getattr(asyncio.current_task(), "cancelling", lambda: 0)():
                    raise  # the request itself is being cancelled (Python 3.11 tells; 3.10 cannot)
                return displaced(), None
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return error_response(413, f"request body is over {limit} bytes; the limit is {limit}"), None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return None, b"".join(chunks)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    reason = {404: f"no route {request.method} {request.url.path}",
              405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(exc.status_code, reason)


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if any(e["type"] == "json_invalid" for e in errors):
        return error_response(400, "request body is not valid JSON")
    fields = [(".".join(str(p) for p in e["loc"] if p != "body") or "body", e["msg"]) for e in errors]
    return error_response(400, "; ".join(f"{name}: {message}" for name, message in fields), fields[0][0])


async def _client_error(request: Request, exc: ClientError) -> JSONResponse:
    response = error_response(exc.status, exc.reason, exc.field, exc.code)
    if exc.retry_after_s is not None:
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    # The exception itself goes to the replica's log (Starlette re-raises it after answering).
    return error_response(500, "internal server error; the server's log has the details")


def install(app: FastAPI, settings: GuardSettings | None = None) -> None:
    """Put the guard in front of `app` and route every error through one shape. Settings may come
    later (`app.state.guard = ...`), before the first request."""
    app.add_middleware(RequestGuard)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(ClientError, _client_error)
    app.add_exception_handler(Exception, _unhandled)
    if settings is not None:
        app.state.guard = settings
