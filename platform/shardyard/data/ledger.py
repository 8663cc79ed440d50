"""A sample ledger: which sample ids each rank trained on at each step, across restarts.

Turned on by `run.sample_ledger` (local or shared-filesystem storage). Each writer (a rank, or a
parameter-server worker) appends to `<run_dir>/ledger/<writer>.jsonl` two kinds of line per step: the ids it is about to train on
(before its gradients leave it), then a commit line once the step is applied. Both carry a round:
the worker group's attempt (its start time, the same on every rank) and, where the group changes
within an attempt, the round: the TorchFT quorum under hot recovery, the generation for parameter
servers.

Why two lines: a step counts once any replica applied it, and then it holds the gradients of every
rank of its round, including one that died or failed before it could commit (an all-reduce that
completed anywhere summed every input). The audit keeps, for each step, the ids of the latest
round that committed it: the trajectory that produced the final model. A step committed by two
rounds of the same attempt means replicas diverged; the audit counts those.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch


class SampleLedger:
    def __init__(self, run_dir: str | Path, writer: str, attempt: float) -> None:
        self.path = Path(run_dir) / "ledger" / f"{writer}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.attempt = attempt

    def training(self, step: int, world_size: int, ids: list[torch.Tensor], quorum: int | None,
                 dp_rank: int = 0) -> None:
        """Before the step: the ids this writer contributes to `step` (numbered from 1), one list
        per micro-step, with the number of data-parallel ranks sharing the step and this writer's
        data-parallel rank (together they place each id in the global sample order)."""
        self._append({"step": step, "world_size": world_size, "dp_rank": dp_rank,
                      "ids": [micro.tolist() for micro in ids]}, quorum)

    def committed(self, step: int, quorum: int | None) -> None:
        self._append({"step": step, "commit": True}, quorum)

    def _append(self, entry: dict, quorum: int | None) -> None:
        # A line is written whole before the process can go on, so it survives a SIGKILL after it.
        with self.path.open("a") as f:
            f.write(json.dumps({"attempt": self.attempt, "quorum": quorum, "time": time.time(), **entry}) + "\n")


@dataclass
class LedgerAudit:
    steps: int                  # steps on the final trajectory
    world_sizes: list[int]      # data-parallel ranks that trained each of those steps
    attempts: int               # worker groups that trained
    complete_epochs: int
    duplicates: int             # samples seen more than once within one complete epoch
    missing: int                # samples of a complete epoch never seen
    diverged_steps: int         # steps that two rounds of one attempt both committed

    @property
    def exact(self) -> bool:
        return self.duplicates == 0 and self.missing == 0 and self.diverged_steps == 0


def audit(run_dir: str | Path, num_samples: int) -> LedgerAudit:
    entries = [json.loads(line) for f in sorted((Path(run_dir) / "ledger").glob("*.jsonl"))
               for line in f.read_text().splitlines() if line.strip()]
    rounds: dict[int, set[tuple[float, int]]] = {}  # step -> the rounds that committed it
    for e in entries:
        if e.get("commit"):
            rounds.setdefault(e["step"], set()).add((e["attempt"], -1 if e["quorum"] is None else e["quorum"]))
    chosen = {step: max(keys) for step, keys in rounds.items()}
    diverged = sum(len([k for k in keys if k[0] == chosen[step][0]]) - 1 for step, keys in rounds.items())
    final = [e for e in entries if "ids" in e and chosen.get(e["step"]) ==
             (e["attempt"], -1 if e["quorum"] is None else e["quorum"])]
    # In global order: a step deals micro-step by micro-step, rank by rank (data/sampler.py), so
    # a step that crosses an epoch's end is cut where the order crosses it.
    placed = sorted((e["step"], micro * e["world_size"] + e["dp_rank"], ids)
                    for e in final for micro, ids in enumerate(e["ids"]))
    seen = [i for _, _, ids in placed for i in ids]
    epochs = len(seen) // num_samples
    duplicates = missing = 0
    for epoch in range(epochs):
        counts = Counter(seen[epoch * num_samples:(epoch + 1) * num_samples])
        duplicates += sum(c - 1 for c in counts.values())
        missing += num_samples - len(counts)
    by_step = {e["step"]: e["world_size"] for e in final}
    return LedgerAudit(len(by_step), [by_step[s] for s in sorted(by_step)],
                       len({e["attempt"] for e in entries}), epochs, duplicates, missing, diverged)
