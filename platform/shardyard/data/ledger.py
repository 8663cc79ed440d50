"""A sample ledger: which sample ids each rank trained on at each step, across restarts.

Turned on by `run.sample_ledger`. Each writer (a rank, or a parameter-server worker) appends to
`<run>/ledger/<writer>.jsonl` in the run's storage (on an object store, which cannot append, the
writer rewrites its file whole: affordable for audits, not for long runs) two kinds of line per
step: the ids it is about to train on
(before its gradients leave it), then a commit line once the step is applied. Both carry a round:
the worker group's attempt (its start time, the same on every rank) and, where the group changes
within an attempt, the round: the TorchFT quorum under hot recovery, the generation for parameter
servers.

Why two lines: a step counts once any replica applied it, and then it holds the gradients of every
rank of its round, including one that died or failed before it could commit (an all-reduce that
completed anywhere summed every input). The audit keeps, for each step, the ids of the round the
final model descends from (`final_rounds`), and counts the steps at which replicas diverged.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from shardyard.storage.events import JsonLines
from shardyard.storage.store import RunStorage

LEDGER_DIR = "ledger"


class SampleLedger:
    def __init__(self, run_uri: str, writer: str, attempt: float) -> None:
        self.file = JsonLines(RunStorage(run_uri), LEDGER_DIR, f"{writer}.jsonl")
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
        self.file.append({"attempt": self.attempt, "quorum": quorum, "time": time.time(), **entry})


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


Round = tuple[float, int]  # (attempt, quorum or -1)


def _round(entry: dict) -> Round:
    return entry["attempt"], -1 if entry["quorum"] is None else entry["quorum"]


def final_rounds(entries: list[dict]) -> tuple[dict[int, Round], int]:
    """For each step, the round whose commit the final model descends from; and the steps at
    which replicas diverged for good.

    A later attempt (a restart from a checkpoint) replaces an earlier one. Within an attempt,
    TorchFT may briefly run two quorums at once (replicas go on without one that has not asked to
    join within the Lighthouse's join timeout): both commit the step, and the branch that did not
    go on is healed away (its replicas jump ahead from a live peer). So, walking back from the last
    step, a step's round is the one that went on to the next step's round: a writer (one file;
    lines in order) committed this step in it and later the next step in that one. Two rounds
    that both went on mean replicas with different states trained on together: divergence."""
    commits: dict[int, dict[Round, list[tuple[str, int]]]] = {}  # step -> round -> (writer, line)
    for e in entries:
        if e.get("commit"):
            commits.setdefault(e["step"], {}).setdefault(_round(e), []).append((e["_writer"], e["_line"]))
    chosen: dict[int, Round] = {}
    diverged = 0
    for step in sorted(commits, reverse=True):
        rounds = commits[step]
        attempt = max(r[0] for r in rounds)
        candidates = [r for r in rounds if r[0] == attempt]
        after = chosen.get(step + 1)
        later = commits[step + 1][after] if after is not None and after[0] == attempt else []
        went_on = [r for r in candidates
                   if any(w == w2 and l2 > l for w, l in rounds[r] for w2, l2 in later)]
        diverged += max(0, len(went_on) - 1)
        chosen[step] = max(went_on or candidates)
    return chosen, diverged


def audit(run_dir: str | Path, num_samples: int) -> LedgerAudit:
    storage = RunStorage(str(run_dir))
    writers = sorted(p.rsplit("/", 1)[-1] for p in storage.fs.ls(storage.path(LEDGER_DIR), detail=False)
                     if p.endswith(".jsonl")) if storage.exists(LEDGER_DIR) else []
    entries = [{**row, "_writer": name, "_line": i}
               for name in writers for i, row in enumerate(JsonLines(storage, LEDGER_DIR, name).read())]
    chosen, diverged = final_rounds(entries)
    final = [e for e in entries if "ids" in e and chosen.get(e["step"]) == _round(e)]
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
