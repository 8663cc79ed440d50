"""The replica's HTTP surface: one FastAPI app per replica, built as the replica starts (Serve's
`__serve_build_asgi_app__`), so that its routes answer from that replica's own parts: the guard
in front of everything (serve/http/guard.py), OpenAI's routes with /healthz and /metrics
(serve/http/openai_routes.py), the operator's routes (serve/http/admin_routes.py).
"""

from __future__ import annotations

from fastapi import FastAPI

from shardyard.serve.http import admin_routes, openai_routes
from shardyard.serve.http.admin_routes import Admin
from shardyard.serve.http.guard import GuardSettings, install
from shardyard.serve.http.openai_routes import Answering


def http_app(guard: GuardSettings, answering: Answering, admin: Admin) -> FastAPI:
    api = FastAPI(title="shardyard")
    install(api, guard)  # auth and body limits before anything else; one error shape
    api.include_router(openai_routes.router)
    api.include_router(admin_routes.router)
    api.state.answering, api.state.admin = answering, admin
    return api
