"""The operator's routes, on an app that follows a run (`follow: true`):

    POST /admin/rollback       back to the weights the app served before, on every replica
    POST /admin/promote        {"step": N}: the run's checkpoint of step N, through the gate, everywhere

Both change what every client is answered with, so they take the operator's token alone (the
app's `admin_token_env` or `admin_token_file`), never the clients': the guard checks it before the
body is read (on the route the router matched), the routes again themselves, and answers 403 where the app has none (off by default). The work is the weight
follower's (serve/follow/follower.py); these routes only speak HTTP for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from shardyard.serve.http.guard import ClientError
from shardyard.serve.follow.follower import OperatorRefused, WeightFollower


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0, description="the step of a committed checkpoint of the served run")


@dataclass
class Admin:
    """What the admin routes act through: the replica's follower (None: the app follows no run)."""
    follower: WeightFollower | None


def follower(request: Request) -> WeightFollower:
    """The follower, on an app that follows a run (the guard has checked the operator's token)."""
    admin: Admin = request.app.state.admin
    if admin.follower is None:
        raise ClientError(409, "the admin routes act on an app that follows a run directory (follow: true)")
    return admin.follower


def operator_only(request: Request) -> None:
    """The operator's token, checked by the routes themselves as well as by the guard: a path
    the guard and the router ever read differently still reaches no admin route without it."""
    refusal = request.app.state.guard.operator_refusal(request.scope)
    if refusal is not None:
        raise ClientError(*refusal, code="invalid_api_key" if refusal[0] == 401 else None)


Follower = Annotated[WeightFollower, Depends(follower)]
router = APIRouter(dependencies=[Depends(operator_only)])


@router.post("/admin/rollback")
async def rollback(f: Follower) -> dict[str, Any]:
    """Back to the weights the app promoted before the current ones; the followers then wait for a
    checkpoint committed after this call."""
    try:
        return await f.rollback()
    except OperatorRefused as err:
        raise ClientError(err.status, err.reason, err.field) from None


@router.post("/admin/promote")
async def promote(body: PromoteRequest, f: Follower) -> dict[str, Any]:
    """The run's checkpoint of `step`, through the same gate; the followers then wait for a
    checkpoint committed after this call."""
    try:
        return await f.promote(body.step)
    except OperatorRefused as err:
        raise ClientError(err.status, err.reason, err.field) from None
