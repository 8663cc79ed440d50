"""A replica following a training run: at each look it serves the run's newest checkpoint (or
the weights the run published to the app, whichever is newer) through the gate
(serve/follow/gate.py), asks the app's Rollout whether it serves it now (a canary), waits, or
refuses it, keeps the steps refused anywhere from being tried again, and applies the operator's
pins. The app-wide record of what serves (AppWeights: serve/follow/app_weights.py) and the Rollout are
reached through objects whose methods are coroutines: Serve's deployment handles in the app
(serve/app/deployment.py), the classes themselves in tests. No HTTP here: the admin routes
(serve/http/admin_routes.py) call `rollback` and `promote`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import ray

from shardyard.checkpoint.generations import attempts, current_lease
from shardyard.checkpoint.loaders import committed_record
from shardyard.checkpoint.published import Published
from shardyard.checkpoint.record import BadCheckpoint, checkpoint_name, newest_good, step_of
from shardyard.storage.store import RunStorage
from shardyard.serve.follow.app_weights import Pin, Source, View, rollback_target
from shardyard.serve.engine.backend import WeightsRefused
from shardyard.serve.resolved import ResolvedConfig
from shardyard.serve.engine.metrics import ServingMetrics
from shardyard.serve.follow.rollout import PROMOTE, REFUSE, WAIT
from shardyard.serve.follow.gate import WeightGate

# How long an operator's call waits for every replica to serve the weights it chose before answering.
PIN_WAIT_S = 60.0


def follows_publish(published: Published, run_name: str, newest_writer: tuple[int, int]) -> bool:
    """Whether a follower of run `run_name` may serve `published`, the run's newest writer being
    `newest_writer` (lease generation, worker group). An older writer's publish came from a launch
    (or group) that had lost the run and published once more before its next fence check: a
    trajectory the new holder discarded. AppWeights keeps a newer writer's publish over it; until
    the new holder publishes, followers pass it over."""
    return published.run == run_name and published.writer >= newest_writer


class OperatorRefused(Exception):
    """An operator's rollback or promotion that cannot be done: `status` says which kind (404 no
    such checkpoint, 409 not now, 422 refused by the gate), as the admin routes answer it."""

    def __init__(self, status: int, reason: str, field: str | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.field = status, reason, field


class WeightFollower:
    def __init__(self, cfg: ResolvedConfig, gate: WeightGate, app_weights: Any, rollout: Any | None,
                 replica: str, metrics: ServingMetrics) -> None:
        """`app_weights`: the app's AppWeights, `rollout`: its Rollout (None: no canary), each
        with coroutine methods; `replica`: this replica's id, as AppWeights counts it."""
        self.cfg, self.gate, self.app_weights, self.rollout = cfg, gate, app_weights, rollout
        self.replica, self.metrics = replica, metrics
        self.served = gate.served
        self.pin_applied = 0  # the serial of the last operator's pin this replica served
        self.unreachable: set[int] = set()  # steps whose published weights are gone from the object store
        self.follow_after = self.served.step or 0  # the follower serves only steps after this

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.follow.interval_s)
            await self.look()

    async def look(self) -> None:
        """Serves each checkpoint the run commits after the served one (and after any an operator
        passed over with a rollback or promotion). A checkpoint that is refused is never tried
        again; one that cannot be read now is tried again. With a canary, the app's Rollout says
        whether this replica serves it now (a canary), waits, serves it (promoted), or refuses it
        (a canary then steps back)."""
        served = self.served
        view: View = await self.app_weights.look(self.replica, served.fingerprint)
        for step, reason in view.refused.items():  # refused on another replica: not tried here
            served.refused.setdefault(step, reason)
        if await self._apply_pin(view.pin):
            return
        candidate = await self._next_candidate(view)
        if candidate is None:
            return
        source, step, made_at = candidate
        role = PROMOTE if self.rollout is None else await self.rollout.role(
            self.replica, step, f"{served.run_name}@{step}", served.fingerprint)
        if role.startswith(REFUSE):
            await self._refused_by_canary(step, role.removeprefix(REFUSE))
            return
        if role == PROMOTE and served.step == step:  # a canary's checkpoint, promoted everywhere
            self.follow_after = step
            await self.app_weights.promote(served.sources[-1])
        if role == WAIT or served.step == step:
            return
        try:
            await self.gate.serve(source)
        except (WeightsRefused, BadCheckpoint) as err:
            print(f"shardyard: {err}: not served; {served.fingerprint} still is", flush=True)
            await self.app_weights.refuse(step, str(err))
            if self.rollout is not None:
                await self.rollout.refuse(step, str(err))
            return
        except ray.exceptions.ObjectLostError:  # its publisher (training's rank 0) is gone
            self.unreachable.add(step)
            print(f"shardyard: the weights published at {source} are gone; the run's checkpoint of that "
                  f"step serves once it is committed", flush=True)
            return
        except Exception as err:  # noqa: BLE001 - the served weights stay; tried again next time
            print(f"shardyard: could not swap in {source} ({type(err).__name__}: {err}); "
                  f"{served.fingerprint} still serves", flush=True)
            return
        if role == PROMOTE:
            self.follow_after = step
            await self.app_weights.promote(source)
        if made_at is not None:
            self.metrics.commit_to_serving.set(time.time() - made_at)

    async def _apply_pin(self, pin: Pin | None) -> bool:
        """Serve an operator's pin this replica has not applied yet (True: one was there). Its
        weights were judged by the replica the operator's call reached: here they are only read
        (and checked finite). One that cannot be read now is tried again at the next look."""
        if pin is None or pin.serial <= self.pin_applied:
            return False
        self.follow_after = max(self.follow_after, pin.follow_after)
        fingerprint = self.served.fingerprint
        try:
            if pin.step != self.served.step:
                await self.gate.serve(pin.source, operator=True, judged=True)
        except (WeightsRefused, BadCheckpoint, ray.exceptions.ObjectLostError) as err:
            print(f"shardyard: the operator's choice of step {pin.step} cannot serve here ({err}); "
                  f"{fingerprint} still serves", flush=True)
        except Exception as err:  # noqa: BLE001 - the served weights stay; tried again next time
            print(f"shardyard: could not swap in the operator's choice of step {pin.step} "
                  f"({type(err).__name__}: {err}); {fingerprint} still serves", flush=True)
            return True
        self.pin_applied = pin.serial
        return True

    async def _next_candidate(self, view: View) -> tuple[Source, int, float | None] | None:
        """The newest weights of the run not served yet (nor refused, nor passed over): its newest
        committed checkpoint or the weights it published last, whichever is newer (at the same
        step, the published ones: no storage read); with their step and when they were made."""
        options = []
        found = await asyncio.to_thread(self._newest_committed)
        if found is not None:
            options.append((step_of(found[0].name), 0, found[0], found[1].get("time")))
        published = view.published
        if published is not None and published.step not in self.unreachable and \
                follows_publish(published, self.served.run_name, await asyncio.to_thread(self._newest_writer)):
            options.append((published.step, 1, published, published.time))
        options = [o for o in options if o[0] > self.follow_after and o[0] not in self.served.refused]
        if not options:
            return None
        step, _, source, made_at = max(options)
        return source, step, made_at

    async def _refused_by_canary(self, step: int, reason: str) -> None:
        """The canary's verdict: nobody serves `step`; a replica that served it as a canary
        returns to the weights it served before."""
        self.served.refused[step] = f"canary: {reason}"
        self.metrics.promotions_refused.inc()
        print(f"shardyard: step {step} refused after its canary: {reason}", flush=True)
        if self.served.step == step and len(self.served.sources) > 1:
            await self.gate.serve(self.served.sources[-2], operator=True)

    def _newest_writer(self) -> tuple[int, int]:
        """The run's newest writer: its newest lease generation and that launch's newest worker
        group ((0, 0): never leased)."""
        storage = RunStorage(self.cfg.source)
        lease = current_lease(storage)
        generation = lease["generation"] if lease else 0
        return generation, max(attempts(storage).get(generation, {0: -1}))

    def _newest_committed(self) -> tuple[Path, dict[str, Any]] | None:
        """The run's newest checkpoint with a valid commit record, and the record. Its files are
        verified once, when a candidate is read (prepare), not on every look at the run."""
        found = newest_good(RunStorage(self.cfg.source), check_files=False)
        return (Path(self.cfg.source).expanduser().absolute() / found[0], found[1]) if found else None

    # ------------------------------------------------------------------ the operator's calls

    async def rollback(self) -> dict[str, Any]:
        """Back to the weights the app promoted before the current ones, on every replica; the
        followers then wait for a checkpoint committed after this call. The step rolled back from
        is refused app-wide (an operator may still promote it), so a second rollback goes further
        back instead of forward to it."""
        served = self.served
        view: View = await self.app_weights.look(self.replica, served.fingerprint)
        target = rollback_target(view.promoted, served.step, {**view.refused, **served.refused})
        if target is None:
            raise OperatorRefused(409, "the app has served no earlier weights to go back to")
        if isinstance(target, Path) and committed_record(target) is None:
            raise OperatorRefused(409, f"the earlier weights ({target.name}) are no longer in the run (pruned); "
                                       f"POST /admin/promote names a step it still holds")
        rolled_back = served.step
        answer = await self._pin(target)
        if rolled_back is not None and rolled_back != answer["served_step"]:
            reason = "rolled back by the operator"
            served.refused[rolled_back] = reason
            await self.app_weights.refuse(rolled_back, reason)
        return answer

    async def promote(self, step: int) -> dict[str, Any]:
        """The run's checkpoint of `step`, through the same gate, on every replica; the followers
        then wait for a checkpoint committed after this call."""
        checkpoint = Path(self.cfg.source).expanduser().resolve() / checkpoint_name(step)
        if committed_record(checkpoint) is None:
            raise OperatorRefused(404, f"the run has no committed checkpoint of step {step}", "step")
        return await self._pin(checkpoint)

    async def _pin(self, checkpoint: Source) -> dict[str, Any]:
        """Serve `checkpoint` here through the gate, then pin it for the app: every replica serves
        it at its next look, and no follower serves a step the run had committed or published by
        now. Answers once every live replica serves it, or after PIN_WAIT_S with how many do."""
        served = self.served
        newest = await asyncio.to_thread(self._newest_committed)
        published: Published | None = (await self.app_weights.look(self.replica, served.fingerprint)).published
        follow_after = max(self.follow_after, step_of(newest[0].name) if newest else 0,
                           published.step if published is not None else 0)
        try:
            await self.gate.serve(checkpoint, operator=True)
        except (WeightsRefused, BadCheckpoint) as err:
            raise OperatorRefused(422, f"{err}: {served.fingerprint} still serves", "step") from None
        except ray.exceptions.ObjectLostError:
            raise OperatorRefused(409, f"the weights published at {checkpoint} are gone (the training worker "
                                       f"that held them exited); {served.fingerprint} still serves") from None
        # Raised once the swap succeeded: a refused promotion leaves this replica following the run.
        self.follow_after = follow_after
        pin: Pin = await self.app_weights.pin(checkpoint, follow_after)
        self.pin_applied = max(self.pin_applied, pin.serial)
        await self.app_weights.look(self.replica, served.fingerprint)  # its own weights: counted now
        deadline = time.monotonic() + PIN_WAIT_S
        while True:
            serving, live = await self.app_weights.serving_count(served.fingerprint)
            if serving >= live or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        return {"served_step": served.step, "system_fingerprint": served.fingerprint,
                "replicas_serving": serving, "replicas": live}
