"""What an app that follows a run serves, app-wide: one AppWeights deployment per such app (Serve
starts and deletes it with the app), which every replica's follower reads at each look.

It holds the newest weights training published to the app (`checkpoint.publish_to`: a reference
into Ray's object store, the weights themselves stay there), the weights the app has promoted in
order (of published ones, the two newest only: each pins a whole model in the object store) (where a replica started later, by autoscaling or to replace one, begins, and what
`/admin/rollback` goes back through), the steps a replica's gate refused (no replica tries them
again), and the operator's pin: the weights `/admin/rollback` or `/admin/promote` chose, which
every replica serves once it sees a pin newer than the last it applied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ray import serve

from shardyard.checkpoint.loaders import committed_record
from shardyard.checkpoint.published import APP_WEIGHTS, Published, source_step
from shardyard.checkpoint.record import checkpoint_name

LIVE_S = 10.0  # a replica that has not looked for this long is gone (scaled down, replaced)
# Published versions a list of sources keeps: the weights serving and those before them (what a
# rollback or a canary stepping back needs). Each pins a whole model in Ray's object store.
KEEP_PUBLISHED = 2

Source = Path | Published  # a checkpoint directory, or weights published through the object store


def with_few_published(sources: list[Source]) -> list[Source]:
    """`sources` in order, without the published weights older than the KEEP_PUBLISHED newest
    steps published (their references dropped, so Ray frees them); checkpoint directories stay
    (a path holds nothing, and training's pruning decides whether they still load)."""
    newest: list[int] = []
    for source in reversed(sources):
        if isinstance(source, Published) and source.step not in newest and len(newest) < KEEP_PUBLISHED:
            newest.append(source.step)
    return [s for s in sources if not isinstance(s, Published) or s.step in newest]


@dataclass(frozen=True)
class Pin:
    """An operator's choice: `source` serves on every replica, and the followers then serve only
    steps after `follow_after` (so the newest checkpoint does not undo the choice)."""
    serial: int
    source: Source
    follow_after: int

    @property
    def step(self) -> int:
        return source_step(self.source)


@dataclass
class View:
    """What a replica's follower reads at each look."""
    published: Published | None
    promoted: list[Source]
    refused: dict[int, str]
    pin: Pin | None


@dataclass
class AppWeightsState:
    published: Published | None = None
    promoted: list[Source] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    pin: Pin | None = None
    serving: dict[str, tuple[str, float]] = field(default_factory=dict)  # replica -> (fingerprint, last look)

    def put(self, published: Published) -> None:
        """Keep `published` if it is newer than what is here (its reference keeps the weights
        alive): of a later launch of the run (or worker group of it), or a later step of the same
        one. A launch (or group) that lost the run and publishes before it notices is an older
        writer: refused, however far its discarded trajectory got."""
        newest = self.published
        if newest is None or published.run != newest.run or \
                (*published.writer, published.step) > (*newest.writer, newest.step):
            self.published = published

    def look(self, replica: str, fingerprint: str, now: float) -> View:
        self.serving[replica] = (fingerprint, now)
        return View(self.published, list(self.promoted), dict(self.refused), self.pin)

    def promote(self, source: Source) -> None:
        """A replica serves `source` as the app's weights: kept unless the app already went past
        its step (a slow replica finishing an older swap), it is the step served now, or an
        operator's pin has passed over it since."""
        step = source_step(source)
        if (self.promoted and step <= source_step(self.promoted[-1])) or (self.pin and step <= self.pin.follow_after):
            return
        self.promoted = with_few_published([*self.promoted, source])

    def refuse(self, step: int, reason: str) -> None:
        self.refused[step] = reason

    def pin_to(self, source: Source, follow_after: int) -> Pin:
        """The operator's choice serves everywhere from now on, whatever was refused or promoted."""
        self.refused.pop(source_step(source), None)
        if not self.promoted or source_step(self.promoted[-1]) != source_step(source):
            self.promoted = with_few_published([*self.promoted, source])
        self.pin = Pin((self.pin.serial if self.pin else 0) + 1, source, follow_after)
        return self.pin

    def live(self, now: float) -> dict[str, str]:
        """The replicas that looked lately, and the weights each served then ("" before its
        first look after loading)."""
        return {replica: served for replica, (served, at) in self.serving.items() if now - at <= LIVE_S}

    def serving_count(self, fingerprint: str, now: float) -> tuple[int, int]:
        """How many live replicas serve `fingerprint`, of how many live."""
        live = self.live(now).values()
        return sum(served == fingerprint for served in live), len(live)


def rollback_target(promoted: list[Source], serving_step: int | None, refused: dict[int, str]) -> Source | None:
    """The weights the app promoted last before the ones it serves now (none refused since)."""
    for source in reversed(promoted):
        step = source_step(source)
        if step != serving_step and step not in refused:
            return source
    return None


def starting_checkpoint(view: View, run_dir: str) -> Path | None:
    """Where a replica starting now begins: the newest weights the app promoted that the run
    still holds committed (published weights: the run's checkpoint of their step). None: the
    run's newest checkpoint (the app has promoted none yet, or training pruned them all)."""
    for source in reversed(view.promoted):
        path = source if isinstance(source, Path) else Path(run_dir).expanduser().resolve() / checkpoint_name(source.step)
        if committed_record(path) is not None:
            return path
    return None


@serve.deployment(name=APP_WEIGHTS, num_replicas=1, ray_actor_options={"num_cpus": 0},
                  logging_config={"enable_access_log": False})  # every replica asks it at each look
class AppWeights:
    """The app's AppWeightsState, where every replica and the training run reach it."""

    def __init__(self) -> None:
        self.state = AppWeightsState()

    def put(self, published: Published) -> None:
        self.state.put(published)

    def look(self, replica: str, fingerprint: str) -> View:
        return self.state.look(replica, fingerprint, time.monotonic())

    def promote(self, source: Source) -> None:
        self.state.promote(source)

    def refuse(self, step: int, reason: str) -> None:
        self.state.refuse(step, reason)

    def pin(self, source: Source, follow_after: int) -> Pin:
        return self.state.pin_to(source, follow_after)

    def serving_count(self, fingerprint: str) -> tuple[int, int]:
        return self.state.serving_count(fingerprint, time.monotonic())

    def replicas(self) -> dict[str, str]:
        return self.state.live(time.monotonic())
