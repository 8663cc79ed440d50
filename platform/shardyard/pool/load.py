"""Serving's load as the arbiter sees it: each replica reports what its engine measured every
second (the same numbers its metrics publish), and the arbiter reads one SLO signal from the
reports still fresh. Pushed rather than scraped from Ray's metrics export, which lags by its
report interval (10 s by default): a lend decided on ten-second-old load would come late.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# A replica silent this long is gone (stopped by Serve, or dead): its last report no longer counts.
STALE_S = 5.0


@dataclass(frozen=True)
class ReplicaLoad:
    running: int           # requests decoding
    waiting: int           # requests admitted, waiting for a KV cache row
    kv_blocks_used: int
    kv_blocks: int
    ttft_s: list[float] = field(default_factory=list)  # time to first token of requests since the last report


class LoadBook:
    def __init__(self, ttft_window_s: float) -> None:
        self.ttft_window_s = max(ttft_window_s, 2.0)
        self.latest: dict[str, tuple[float, ReplicaLoad]] = {}
        self.ttft: deque[tuple[float, float]] = deque()

    def report(self, replica: str, load: ReplicaLoad, now: float) -> None:
        self.latest[replica] = (now, load)
        self.ttft.extend((now, t) for t in load.ttft_s)

    def fresh(self, now: float) -> list[ReplicaLoad]:
        return [load for at, load in self.latest.values() if now - at <= STALE_S]

    def signal(self, name: str, now: float) -> float | None:
        """The signal `name` (pool.spec.SIGNALS) now; None while no replica reports."""
        while self.ttft and now - self.ttft[0][0] > self.ttft_window_s:
            self.ttft.popleft()
        loads = self.fresh(now)
        if not loads:
            return None
        if name == "queue_length":
            return sum(load.running + load.waiting for load in loads) / len(loads)
        if name == "kv_occupancy":
            total = sum(load.kv_blocks for load in loads)
            return sum(load.kv_blocks_used for load in loads) / total if total else 0.0
        samples = sorted(t for _, t in self.ttft)
        if not samples:
            return None
        return 1000 * samples[min(len(samples) - 1, int(0.9 * len(samples)))]
