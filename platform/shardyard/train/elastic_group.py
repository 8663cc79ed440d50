"""An elastic worker group: who trains, generation by generation, so that workers can leave and
join a running group at a step boundary instead of restarting it from storage.

The group's keeper (the driver that decides the group's size) hosts a torch.distributed store and
publishes each generation there: its number and its members in rank order, those that stay first
(in their old order), then those that join. Workers read it through a `Roster`: rank 0 reads the
newest number once a step (the step guard spreads it to every rank in its all-reduce), and at the
next step boundary every member of the old group gives its state to the first member that stays,
the old process group is ended, and the new generation's members form a new one (a store prefix of
its own per generation). A leaver stops there; a joiner, started beforehand and ready, takes the
model, the optimizer, the schedule and the data position from that peer (train/trainer.py).

Each worker also beats in the store twice a second, from a thread of its own. After a failed
collective, a member that hears every member's beat for a few seconds knows none was lost: the
error was the training code's, and it stands at once instead of waiting for a generation that
will not come.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from shardyard.parallel import Engine

GENERATION_KEY = "generation"
ATTEMPT_KEY = "attempt"
# How long members wait for each other while a new generation forms (a joiner's store connection,
# the new process group's rendezvous) before the change fails.
FORM_TIMEOUT = timedelta(seconds=120)
BEAT_S = 0.5  # how often a worker says it is alive
# A member whose beat has not moved for this long may be lost (its process or node); one that
# beat is not. Seconds beyond a beat's period: a loaded machine delays a thread's wake-ups.
SILENT_S = 3.0


def members_key(number: int) -> str:
    return f"members/{number}"


def ready_key(name: str) -> str:
    return f"ready/{name}"


def beat_key(name: str) -> str:
    return f"beat/{name}"


def formed_key(number: int) -> str:
    return f"formed/{number}"


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[str, ...]  # in rank order

    def rank_of(self, name: str) -> int:
        return self.members.index(name)


def read_generation(store: dist.Store, number: int) -> Generation:
    return Generation(number, tuple(json.loads(store.get(members_key(number)))))


class RosterKeeper:
    """The driver's side: hosts the store and publishes each change of the group."""

    def __init__(self, members: Sequence[str], host: str = "127.0.0.1", port: int = 0) -> None:
        if not members or len(set(members)) != len(members):
            raise ValueError(f"an elastic group needs one or more distinct members, not {list(members)}")
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=FORM_TIMEOUT)
        self.address = f"{host}:{self.store.port}"
        # One id for the group's whole life (the sample ledger's attempt): it never restarts.
        self.store.set(ATTEMPT_KEY, repr(time.time()))
        self.current = Generation(0, tuple(members))
        self._publish(self.current)

    def _publish(self, generation: Generation) -> None:
        self.store.set(members_key(generation.number), json.dumps(list(generation.members)))
        self.store.set(GENERATION_KEY, str(generation.number))  # last: whoever sees it finds the members

    def is_ready(self, name: str) -> bool:
        """Whether the worker `name` has started and can join (its Roster said so)."""
        return self.store.check([ready_key(name)])

    def generation(self, number: int) -> Generation:
        return read_generation(self.store, number)

    def change(self, leave: Sequence[str] = (), join: Sequence[str] = (),
               timeout_s: float = FORM_TIMEOUT.total_seconds()) -> Generation:
        """Publish the next generation: `leave` go at the group's next step boundary, `join` (each
        started and ready) come in there. At least one member must stay: joiners take their state
        from a live peer. Waits first until the current generation has formed its process group:
        members skip no generation, and a joiner forms the one that names it."""
        members = self.current.members
        if unknown := [name for name in leave if name not in members]:
            raise ValueError(f"cannot remove {unknown}: the group's members are {list(members)}")
        if already := [name for name in join if name in members]:
            raise ValueError(f"{already} are members already")
        stay = [name for name in members if name not in leave]
        if not stay:
            raise ValueError("every member would leave: a joiner takes its state from a member that stays")
        self.store.wait([formed_key(self.current.number)], timedelta(seconds=timeout_s))
        self.current = Generation(self.current.number + 1, (*stay, *join))
        self._publish(self.current)
        return self.current


class Roster:
    """A worker's side: reads the keeper's generations and forms each one's process group."""

    def __init__(self, address: str, name: str) -> None:
        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=FORM_TIMEOUT)
        self.name = name
        self.attempt = float(self.store.get(ATTEMPT_KEY))
        self.current: Generation | None = None  # the generation whose process group this worker is in
        threading.Thread(target=self._beat, args=(host, int(port)), name="shardyard-beat", daemon=True).start()

    def _beat(self, host: str, port: int) -> None:
        """Say this worker is alive every BEAT_S, on a store connection of this thread's own, until
        the keeper's store is gone (the run ended)."""
        store = dist.TCPStore(host, port, is_master=False, timeout=FORM_TIMEOUT)
        try:
            while True:
                store.add(beat_key(self.name), 1)
                time.sleep(BEAT_S)
        except RuntimeError:  # the store's connection closed
            return

    def beats(self, members: Sequence[str]) -> dict[str, int]:
        return {name: self.store.add(beat_key(name), 0) for name in members}

    def newest(self) -> int:
        return int(self.store.get(GENERATION_KEY))

    def generation(self, number: int) -> Generation:
        return read_generation(self.store, number)

    def wait_for_change(self, after: int, members: Sequence[str] = (),
                        timeout_s: float = FORM_TIMEOUT.total_seconds(), poll_s: float = 0.05) -> int | None:
        """The first generation newer than `after` (the driver publishes one without a member it
        lost); None if none comes within `timeout_s`, or as soon as every one of `members` has
        beaten within SILENT_S (none of them was lost)."""
        deadline = time.monotonic() + timeout_s
        heard, since = self.beats(members), time.monotonic()
        while (newest := self.newest()) == after:
            now = time.monotonic()
            if now > deadline:
                return None
            if members and now - since >= SILENT_S:
                beats = self.beats(members)
                if all(beats[name] > heard[name] for name in members):
                    return None
                heard, since = beats, now  # one was silent: it may be lost, the driver will say
            time.sleep(poll_s)
        return newest

    def wait_for_membership(self, poll_s: float = 0.05) -> Generation:
        """Say this worker is ready, then wait until a generation names it (at once for a member
        of the first)."""
        self.store.set(ready_key(self.name), "1")
        while True:
            generation = self.generation(self.newest())
            if self.name in generation.members:
                return generation
            time.sleep(poll_s)

    def form(self, generation: Generation, backend: str) -> None:
        """Collective over `generation`'s members: the default process group becomes theirs."""
        store = dist.PrefixStore(f"group/{generation.number}/", self.store)
        rank = generation.rank_of(self.name)
        # DTensor remembers each op's output sharding by its inputs' meshes, and a mesh is known by
        # its shape, not by the process group or rank it was made for: an answer remembered in an
        # earlier generation would hand this one's tensors a mesh of that generation (its rank).
        _clear_sharding_prop_cache()
        dist.init_process_group(backend, store=store, rank=rank, world_size=len(generation.members),
                                timeout=FORM_TIMEOUT)
        dist.barrier()  # some backends connect lazily: here every member has joined
        self.current = generation
        if rank == 0:  # the keeper may publish the next generation
            self.store.set(formed_key(generation.number), "1")


@dataclass
class Held:
    """An engine's whole state, as the member that hands it over holds it between two generations."""
    model: dict[str, Any]
    optimizer: dict[str, Any]
    checkpointed: dict[str, Any]  # the state of what the engine checkpoints beside them (the schedule)


def hand_over(engine: Engine, holder: int, alone: bool = False) -> Held | None:
    """Collective over the old group: the engine's whole state (the model's and optimizer's
    gathered from the ranks' shards where they are sharded) on rank `holder`; None elsewhere.
    `alone`: the old group is broken (a member was lost) and each rank holds the whole state
    (Engine.whole_replicas): the holder reads its own, with no collective."""
    if len(engine.parts) != 1 or engine.checkpoint_format != "dcp":
        raise ValueError("an elastic group changes size in place under ddp and fsdp only")
    if alone and dist.get_rank() != holder:
        return None
    # torch gathers a full state to rank 0 alone (cpu_offload) or to every rank: the latter only
    # when rank 0 is leaving.
    options = StateDictOptions() if alone else StateDictOptions(full_state_dict=True, cpu_offload=holder == 0)
    model, optimizer = get_state_dict(engine.model, engine.optimizers, options=options)
    if dist.get_rank() != holder:
        return None
    return Held(model, optimizer, {key: part.state_dict() for key, part in engine.checkpointed().items()})


def take_over(engine: Engine, held: Held | None) -> None:
    """Collective over the new group: rank 0's `held` state into every rank's freshly built
    engine, each rank keeping its own shards of it."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(engine.model, held.model if held is not None else {}, options=options)
    # torch broadcasts an optimizer's state by its tensors: a stateless optimizer's (plain SGD)
    # is its groups' settings alone, which go with the rest.
    stateless = held is not None and not held.optimizer["state"]
    rest = [None if held is None else (
        [{key: value for key, value in group.items() if key != "params"} for group in held.optimizer["param_groups"]]
        if stateless else None, held.checkpointed)]
    dist.broadcast_object_list(rest, src=0)
    settings, checkpointed = rest[0]
    if settings is None:
        set_optimizer_state_dict(engine.model, engine.optimizers, held.optimizer if held is not None else {},
                                 options=options)
    else:
        for group, setting in zip(engine.optimizers[0].param_groups, settings, strict=True):
            group.update(setting)
    for key, part in engine.checkpointed().items():
        part.load_state_dict(checkpointed[key])
