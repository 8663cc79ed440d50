"""Canary rollouts of a followed run's checkpoints. With several replicas and `follow.canary`, a
checkpoint that passed a replica's gate first serves on a share of the replicas (the canaries),
so it answers about that share of the traffic; once it has served for `window_s` and
answered at least `min_requests` requests, its error rate and mean latency are compared
with those of the weights the other replicas served over the same window, and it goes to every
replica or to none (the canaries step back).

One Rollout deployment per app holds the trial (Serve starts and deletes it with the app);
replicas ask it what to do with each new checkpoint and report what their answers cost, counted
by the weights that made them (the fingerprint), not by replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ray import serve

from shardyard.serve.config import CanarySettings

LIVE_S = 10.0  # a replica that has not reported for this long is gone (scaled down, replaced)
PROMOTE = "promote"
CANARY = "canary"
WAIT = "wait"
REFUSE = "refuse: "  # followed by the reason


@dataclass
class Tally:
    """Requests answered by one set of weights: how many succeeded, failed, and the successes'
    seconds, summed."""
    answered: int = 0
    failed: int = 0
    seconds: float = 0.0

    def record(self, seconds: float, ok: bool) -> None:
        if ok:
            self.answered += 1
            self.seconds += seconds
        else:
            self.failed += 1

    def since(self, earlier: Tally) -> Tally:
        return Tally(self.answered - earlier.answered, self.failed - earlier.failed, self.seconds - earlier.seconds)

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.answered + other.answered, self.failed + other.failed, self.seconds + other.seconds)

    @property
    def requests(self) -> int:
        return self.answered + self.failed

    @property
    def error_rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    @property
    def mean_s(self) -> float:
        return self.seconds / self.answered if self.answered else 0.0


def verdict(canary: Tally, baseline: Tally, settings: CanarySettings) -> str | None:
    """Why the canary's weights must not serve everywhere (None: they may)."""
    if canary.error_rate > baseline.error_rate + settings.max_error_increase:
        return (f"the canary failed {canary.error_rate:.1%} of {canary.requests} requests against "
                f"{baseline.error_rate:.1%} of {baseline.requests} on the served weights")
    # Slower by both the ratio and the margin: on a busy node a fast model's few milliseconds of
    # noise (a replica that has just loaded weights, a neighbour's burst) can be 1.5x alone.
    limit = max(baseline.mean_s * settings.max_latency_ratio, baseline.mean_s + settings.latency_margin_s)
    if baseline.answered and canary.mean_s > limit:
        return (f"the canary answered in {canary.mean_s:.3f} s on average against {baseline.mean_s:.3f} s on "
                f"the served weights (more than {settings.max_latency_ratio:g}x and "
                f"{settings.latency_margin_s:g} s slower)")
    return None


@dataclass
class Trial:
    step: int
    fingerprint: str
    baseline: str  # the weights served when the trial began
    canaries: set[str]
    started: float | None = None  # when a canary first reported serving it
    baseline_at_start: Tally = field(default_factory=Tally)


class CanaryTrials:
    """The rollout's state and decisions, one trial at a time (a newer checkpoint waits for it)."""

    def __init__(self, settings: CanarySettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.clock = settings, clock
        self.seen: dict[str, float] = {}
        self.tallies: dict[str, dict[str, Tally]] = {}
        self.trial: Trial | None = None
        self.decided: dict[int, str] = {}  # step -> PROMOTE or REFUSE + reason

    def report(self, replica: str, serving: str, tallies: dict[str, Tally]) -> None:
        """`replica` serves the weights `serving` and has answered `tallies` so far."""
        self.seen[replica], self.tallies[replica] = self.clock(), tallies
        trial = self.trial
        if trial is not None and trial.started is None and serving == trial.fingerprint:
            trial.started, trial.baseline_at_start = self.clock(), self.total(trial.baseline)

    def live(self) -> list[str]:
        return sorted(r for r, at in self.seen.items() if self.clock() - at <= LIVE_S)

    def total(self, fingerprint: str) -> Tally:
        return sum((t.get(fingerprint, Tally()) for t in self.tallies.values()), Tally())

    def role(self, replica: str, step: int, fingerprint: str, serving: str) -> str:
        """What `replica`, serving `serving`, does with the checkpoint of `step`: serve it as a
        canary, serve it (promoted), wait, or refuse it (REFUSE + the reason)."""
        self.seen[replica] = self.clock()
        if step in self.decided:
            return self.decided[step]
        live = self.live()
        if self.trial is not None and not self.trial.canaries & set(live):
            self.trial = None  # its canaries are gone: pick again
        if self.trial is None:
            share = min(len(live) - 1, max(1, round(self.settings.fraction * len(live))))
            if share < 1:  # one replica: nobody to compare with
                self.decided[step] = PROMOTE
                return PROMOTE
            self.trial = Trial(step, fingerprint, serving, set(live[:share]))
        if self.trial.step != step:
            return WAIT
        self._judge()
        if step in self.decided:
            return self.decided[step]
        return CANARY if replica in self.trial.canaries else WAIT

    def refuse(self, step: int, reason: str) -> None:
        """A canary's own gate refused the checkpoint: nobody serves it."""
        self.decided[step] = REFUSE + reason
        if self.trial is not None and self.trial.step == step:
            self.trial = None

    def _judge(self) -> None:
        trial = self.trial
        if trial is None or trial.started is None or self.clock() - trial.started < self.settings.window_s:
            return
        canary = self.total(trial.fingerprint)
        if canary.requests < self.settings.min_requests:
            return
        why = verdict(canary, self.total(trial.baseline).since(trial.baseline_at_start), self.settings)
        self.decided[trial.step] = PROMOTE if why is None else REFUSE + why
        self.trial = None


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # replicas call it every second
class Rollout:
    """The app's CanaryTrials, where every replica reaches it."""

    def __init__(self, settings: CanarySettings) -> None:
        self.trials = CanaryTrials(settings)

    def report(self, replica: str, serving: str, tallies: dict[str, Tally]) -> None:
        self.trials.report(replica, serving, tallies)

    def role(self, replica: str, step: int, fingerprint: str, serving: str) -> str:
        return self.trials.role(replica, step, fingerprint, serving)

    def refuse(self, step: int, reason: str) -> None:
        self.trials.refuse(step, reason)
