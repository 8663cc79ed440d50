"""A sample ledger: which sample ids each rank trained on at each step, across restarts.

Turned on by `run.sample_ledger` (local or shared-filesystem storage). Each rank appends one line
per step to `<run_dir>/ledger/rank<R>.jsonl`, tagged with the worker group's attempt (its start
time, the same on every rank). Steps after the last checkpoint are recomputed after a failure, so
the audit keeps, for every step, the entries of the latest attempt that ran it: the trajectory
that produced the final model.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch


class SampleLedger:
    def __init__(self, run_dir: str | Path, rank: int, attempt: float) -> None:
        self.path = Path(run_dir) / "ledger" / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.attempt = attempt

    def record(self, step: int, world_size: int, ids: list[torch.Tensor]) -> None:
        entry = {"attempt": self.attempt, "step": step, "world_size": world_size, "time": time.time(),
                 "ids": torch.cat(ids).tolist()}
        with self.path.open("a") as f:
            f.write(json.dumps(entry) + "\n")


@dataclass
class LedgerAudit:
    steps: int                  # steps on the final trajectory
    world_sizes: list[int]      # world size of each of those steps
    attempts: int               # worker groups that trained
    complete_epochs: int
    duplicates: int             # samples seen more than once within one complete epoch
    missing: int                # samples of a complete epoch never seen

    @property
    def exact(self) -> bool:
        return self.duplicates == 0 and self.missing == 0


def audit(run_dir: str | Path, num_samples: int) -> LedgerAudit:
    entries = [json.loads(line) for f in sorted((Path(run_dir) / "ledger").glob("rank*.jsonl"))
               for line in f.read_text().splitlines() if line.strip()]
    latest = {}
    for e in entries:
        latest[e["step"]] = max(latest.get(e["step"], e["attempt"]), e["attempt"])
    final = sorted((e for e in entries if e["attempt"] == latest[e["step"]]), key=lambda e: e["step"])
    seen = [i for e in final for i in e["ids"]]
    epochs = len(seen) // num_samples
    duplicates = missing = 0
    for epoch in range(epochs):
        counts = Counter(seen[epoch * num_samples:(epoch + 1) * num_samples])
        duplicates += sum(c - 1 for c in counts.values())
        missing += num_samples - len(counts)
    by_step = {e["step"]: e["world_size"] for e in final}
    return LedgerAudit(len(by_step), [by_step[s] for s in sorted(by_step)],
                       len({e["attempt"] for e in entries}), epochs, duplicates, missing)
