"""Which launch a checkpoint belongs to: the run's lease generations, as checkpoints see them.

Each launch of a run holds the run's lease at a generation of its own (lease.py) and writes that
generation into every commit record. A launch can be paused after its fence check passed (GC,
SIGSTOP, a slow fsync) while another launch takes the run over; its commit may then land later,
on top of the new holder's history. Such a commit must not count.

So each lease generation G records, when it is taken, the step of the newest checkpoint then
committed (`base_step`), and carries forward every earlier generation's *ceiling*: the highest
step a checkpoint of that generation may have and still be part of the run's history,

    ceiling[g] = min(base_step of every generation after g).

A checkpoint of generation g at a step above ceiling[g] was committed after a later launch had
started from an older one: restore, pruning, serving and export treat it as not committed. The
newest lease record holds the whole map, so older lease files can be removed. A record without
a generation (written before generations were recorded) counts as generation 0.

Each commit record also carries its writer's base step, so the records alone state the same
ceilings: a run whose `lease/` was lost (cleared, left out of a copy) or a checkpoint copied out
of its run is judged from them. A record of a generation above the newest lease's is of a lineage
this run's lease does not know: it counts (nothing says it is stale), and a launch is refused the
run until it is told to take it over (lease.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from shardyard.storage.store import RunStorage

LEASE_DIR = "lease"


def read_json(storage: RunStorage, *parts: str) -> dict[str, Any] | None:
    try:
        return json.loads(storage.read_bytes(*parts))
    except (FileNotFoundError, json.JSONDecodeError):  # released, or being replaced, as it was read
        return None


ATTEMPT_INFIX = ".attempt-"  # lease/<generation:08d>.attempt-<k:06d>.json: one per worker group


def attempt_file(generation: int, attempt: int) -> str:
    return f"{generation:08d}{ATTEMPT_INFIX}{attempt:06d}.json"


def attempts(storage: RunStorage) -> dict[int, dict[int, int]]:
    """Each generation's worker-group attempts and the step each started from."""
    found: dict[int, dict[int, int]] = {}
    for name in storage.list(LEASE_DIR):
        generation, infix, rest = name.partition(ATTEMPT_INFIX)
        if infix and generation.isdigit() and rest.endswith(".json") and rest[:-5].isdigit():
            record = read_json(storage, LEASE_DIR, name) or {}
            found.setdefault(int(generation), {})[int(rest[:-5])] = int(record.get("base_step", -1))
    return found


def current_lease(storage: RunStorage) -> dict[str, Any] | None:
    """The record of the highest lease generation, or None if the run was never leased."""
    names = [n for n in storage.list(LEASE_DIR) if n.endswith(".json") and n[:-5].isdigit()]
    for name in sorted(names, reverse=True):
        record = read_json(storage, LEASE_DIR, name)
        if record is not None:
            return record
        # a file is made whole (linked or PUT at once): an unreadable one was removed meanwhile
    return None


class Lineage:
    """The ceilings of the run's lease generations, as its newest lease record states them."""

    def __init__(self, lease: dict[str, Any] | None, groups: dict[int, dict[int, int]] | None = None) -> None:
        self.generation = int(lease["generation"]) if lease else 0
        self.ceilings = {int(g): int(step) for g, step in (lease or {}).get("ceilings", {}).items()}
        # Within a generation, each worker group's attempt and the step it started from: a
        # group Ray Train gave up on that still runs commits under its launch's generation too.
        self.groups = groups or {}

    @classmethod
    def of(cls, storage: RunStorage) -> Lineage:
        return cls(current_lease(storage), attempts(storage))

    def after_taking(self, generation: int, base_step: int, also: Iterable[int] = ()) -> dict[str, int]:
        """The ceilings a lease taken at `generation` records, the run's newest checkpoint being
        at `base_step` (-1: none): every earlier generation's (and those of `also`, generations
        only records name), lowered to `base_step`."""
        ceilings = {g: min(step, base_step) for g, step in self.ceilings.items()}
        for g in {0, self.generation, *also}:
            ceilings[g] = min(ceilings.get(g, base_step), base_step)
        return {str(g): step for g, step in sorted(ceilings.items()) if g < generation}

    def with_records(self, records: Iterable[dict[str, Any]]) -> Lineage:
        """This lineage with the ceilings the commit records state (each names its generation and
        the base step its launch started from)."""
        merged = Lineage(None, self.groups)
        merged.generation, merged.ceilings = self.generation, dict(self.ceilings)
        for record in records:
            base, generation = record.get("base_step"), record.get("generation", 0)
            if isinstance(base, int) and not isinstance(base, bool):
                for earlier in range(generation):
                    merged.ceilings[earlier] = min(merged.ceilings.get(earlier, base), base)
        return merged

    def stale(self, record: dict[str, Any]) -> str | None:
        """Why the checkpoint `record` commits is not part of the run's history (None: it is, or
        nothing known says otherwise)."""
        generation = record.get("generation", 0)
        attempt = record.get("attempt")
        if isinstance(attempt, int):
            later = [base for a, base in self.groups.get(generation, {}).items() if a > attempt]
            if later and record["step"] > min(later):
                return (f"was committed by worker group {attempt} of lease generation {generation} after a later "
                        f"group of that launch had started from step {min(later)} (a stale group's commit)")
        ceiling = self.ceilings.get(generation)
        if ceiling is not None and record["step"] > ceiling:
            return (f"was committed by lease generation {generation} after a later launch had taken the run over "
                    f"from step {ceiling} (a stale writer's commit)")
        return None
