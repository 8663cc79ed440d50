"""The arbiter's decisions, as plain code over what it observed (no Ray here): when training lends
a device to serving, and when serving's device goes back.

A lend needs all of: serving has priority; the SLO signal has been over its bound for `for_s`
(counted from the last decision too, so one breach lends one device at a time); Serve wants a
replica that no device holds and none is free for it (a replica starting on a device it holds
waits for nothing); training is above its min_workers. A
return needs: a device is lent; one is free (Serve let a replica go); the signal within bound
for `cool_down_s` since the last breach and since the last decision; Serve wants no replica it
lacks. Nothing is decided while the run is restarting at a new size. Serving's own min_replicas
are never touched: the arbiter takes back only devices Serve has released.

An app scaled to zero (`autoscaling.min_replicas: 0`) reports no load, so no SLO can be breached:
a request arriving then makes Serve want a replica while none serves, and that is a wake. Training
(priority serving, above its min_workers) lends a device at once: a wake waits for no breach and is
held to no dwell, back-off or budget (nor counted in them), since every request waits until a
replica serves.

Flapping is bounded, since every lend and return restarts training: a lend waits for a breach
of at least `resize_cost_s` (a shorter burst is cheaper to serve through than to resize for),
doubled for each lend in the last hour; at most `max_lends_per_hour`; and the run stays at each
size for `min_dwell_s`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardyard.pool.spec import Policy
from shardyard.storage.events import Event


@dataclass(frozen=True)
class Observation:
    now: float
    signal: float | None      # the SLO signal now (None: no replica has reported)
    replicas_running: int     # Serve's replicas that serve
    replicas_wanted: int      # replicas Serve wants (running, starting, or waiting for a device)
    free_devices: float       # devices of the pool no one holds
    training_size: int | None  # the run's world size now; None while it stops or restarts
    devices: float            # devices in the pool

    def waiting_for_device(self) -> bool:
        """Serve wants a replica that no device holds (not one starting on a device it has), and
        none is free: the devices neither training nor free are serving's."""
        serving_holds = self.devices - self.free_devices - (self.training_size or 0)
        return self.replicas_wanted > serving_holds and self.free_devices < 1


@dataclass(frozen=True)
class Decision:
    kind: Event  # LEND or RETURN
    from_workers: int
    to_workers: int
    reason: str
    wake: bool = False  # a lend to an app scaled to zero


class Arbitration:
    def __init__(self, policy: Policy, min_workers: int, max_workers: int, start_workers: int) -> None:
        self.policy = policy
        self.min_workers, self.max_workers = min_workers, max_workers
        self.allotment = start_workers  # the world size the run is to train at
        self.lent = 0
        self.breach_since: float | None = None
        self.last_breach = -math.inf
        self.last_decision = -math.inf
        self.lends: list[float] = []  # when each lend was decided

    def breached(self, signal: float | None) -> bool:
        return signal is not None and signal > self.policy.lend_when.above

    def observe(self, o: Observation) -> Decision | None:
        """Take one observation; the decision it calls for, if any (`allotment` already changed)."""
        if self.breached(o.signal):
            self.breach_since = o.now if self.breach_since is None else self.breach_since
            self.last_breach = o.now
        else:
            self.breach_since = None
        if o.training_size != self.allotment:  # a resize under way: hysteresis, nothing new
            return None
        lend, policy = self.policy.lend_when, self.policy
        unplaced = o.waiting_for_device()
        if policy.priority == "serving" and unplaced and o.replicas_running == 0 and self.allotment > self.min_workers:
            return self._decide(o.now, Event.LEND, -1, "a request waits and no replica serves (scaled to zero)", wake=True)
        dwelt = o.now - self.last_decision >= policy.min_dwell_s
        recent = [t for t in self.lends if o.now - t < 3600]
        required = max(lend.for_s, policy.resize_cost_s) * 2 ** len(recent)  # backs off as lends repeat
        if (policy.priority == "serving" and self.breach_since is not None and unplaced and dwelt
                and len(recent) < policy.max_lends_per_hour
                and o.now - max(self.breach_since, self.last_decision) >= required
                and self.allotment > self.min_workers):
            self.lends = [*recent, o.now]
            return self._decide(o.now, Event.LEND, -1, f"{lend.signal} {o.signal:.3g} over {lend.above:g} for "
                                f"{o.now - self.breach_since:.0f} s, {o.replicas_wanted - o.replicas_running} "
                                f"replica(s) waiting for a device")
        calm_since = max(self.last_breach, self.last_decision)
        if (self.lent and o.free_devices >= 1 and o.replicas_wanted <= o.replicas_running and dwelt
                and self.breach_since is None and o.now - calm_since >= policy.cool_down_s
                and self.allotment < self.max_workers):
            return self._decide(o.now, Event.RETURN, +1, f"{lend.signal} within {lend.above:g} for "
                                f"{o.now - calm_since:.0f} s and a device free")
        return None

    def _decide(self, now: float, kind: Event, change: int, reason: str, wake: bool = False) -> Decision:
        before = self.allotment
        self.allotment += change
        self.lent -= change
        self.last_decision = now
        return Decision(kind, before, self.allotment, reason, wake)
