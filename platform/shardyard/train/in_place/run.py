"""A launch whose group changes size in place (`scaling.resize: in_place`): this driver keeps the
group's generations (train/elastic_group.py), starts one GroupWorker actor per member, and changes
the group at the size asked for: a shrink tells the newest members to leave at the next step
boundary (their actors end and their resources go back to Ray); a growth starts the new members,
waits until they are ready, and lets them join there, taking their state from a live peer. No
checkpoint is read or written for a change.

Without a pool, an elastic run grows when room appears (a node joins): the new workers join as
any joiner does.

A worker lost under DDP (its process or node; every member holds the whole state) is left out:
the survivors' next collective fails, they form the next generation without it and go on from
the first survivor's state, and a replacement joins as any new member does. Any other failure
(a sharded state lost with its worker, an error of the training code) restarts the whole group
from the newest checkpoint, as a Ray Train launch does, up to `scaling.max_failures` times.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError

from shardyard.checkpoint.lease import RunLease
from shardyard.checkpoint.record import newest_step
from shardyard.spec import JobSpec
from shardyard.storage.events import Event, log_event
from shardyard.storage.store import RunStorage
from shardyard.train.early_sigterm import stop_if_terminated
from shardyard.train.elastic_group import RosterKeeper
from shardyard.train.in_place.worker import GroupWorker
from shardyard.train.metrics import RunResult
from shardyard.train.outcomes import RunGaveUp, launch_result
from shardyard.train.preemption import StoppedAtOnce, preemption_notice, stopped_at_once
from shardyard.train.ray_train.worker_resources import WorkerPlacement, place_workers
from shardyard.train.restart_lines import restarts_allowed

POLL_S = 0.2  # how often the driver looks at its workers and at the size asked for


class WorkerFailed(RuntimeError):
    def __init__(self, name: str, rank: int | None, err: RayError) -> None:
        super().__init__(f"{name}: {type(err).__name__}: {err}"[:300])
        self.name, self.rank = name, rank
        # Raised by the training code, not Ray's report of a lost process or node.
        self.from_code = isinstance(err, RayTaskError)


class InPlaceGroup:
    """The workers of one group, from its start to its end, by member name."""

    def __init__(self, spec: JobSpec, placement: WorkerPlacement, config: dict[str, Any], size: int) -> None:
        self.spec, self.placement, self.config = spec, placement, config
        self.names = (f"worker{i}" for i in itertools.count())
        self.workers: dict[str, Any] = {}
        self.running: dict[ray.ObjectRef, str] = {}  # each worker's train() call
        self.joining: list[str] = []  # started, to join once every one of them is ready
        first = [next(self.names) for _ in range(size)]
        self.keeper = RosterKeeper(first, host=ray.util.get_node_ip_address())
        for name in first:
            self._start(name)

    @property
    def size(self) -> int:
        return len(self.keeper.current.members)

    def _start(self, name: str) -> None:
        resources = dict(self.placement.resources)
        cpus, gpus = resources.pop("CPU", 0.0), resources.pop("GPU", 0.0)
        actor = GroupWorker.options(num_cpus=cpus, num_gpus=gpus, resources=resources, name=None).remote(
            max(1, math.floor(cpus)))
        self.workers[name] = actor
        self.running[actor.train.remote(name, self.keeper.address, self.spec, self.config)] = name

    def resize(self, size: int) -> None:
        """Move toward `size`, called again each poll until the group has it: a shrink tells the
        newest members to leave; a growth starts new workers, and once all of them are ready (Ray
        placed them and they started) lets them join. The group changes at its next step boundary."""
        members = self.keeper.current.members
        if self.joining and size <= len(members):  # the growth is no longer wanted
            for name in self.joining:
                self._end(name)
            self.joining = []
        if self.joining:
            if all(self.keeper.is_ready(name) for name in self.joining):
                self._change(join=self.joining)
                self.joining = []
        elif size < len(members):
            self._change(leave=members[size:])
        elif size > len(members):
            self.joining = [next(self.names) for _ in range(size - len(members))]
            for name in self.joining:
                self._start(name)

    def wait(self, timeout_s: float) -> bool:
        """Whether every worker has ended; WorkerFailed if one failed. A worker that left is ended
        at once, so that its resources go back to Ray."""
        done, _ = ray.wait(list(self.running), num_returns=len(self.running), timeout=timeout_s)
        for ref in done:
            name = self.running.pop(ref)
            try:
                ended = ray.get(ref)
            except RayError as err:
                members = self.keeper.current.members
                self._end(name)
                raise WorkerFailed(name, members.index(name) if name in members else None, err) from None
            self._end(name)
            if not ended["left"]:  # the run ended: a worker named by no generation it formed never will be
                last = self.keeper.generation(ended["generation"]).members
                for waiting in [n for n in self.workers if n not in last]:
                    self._end(waiting)
        return not self.running

    def _end(self, name: str) -> None:
        ray.kill(self.workers.pop(name))
        self.running = {ref: n for ref, n in self.running.items() if n != name}

    def leave_out(self, lost: WorkerFailed) -> bool:
        """Go on without a worker whose process or node was lost (an error of the training code
        would come back: False, the group must restart): one not yet joined or already gone is
        dropped (the growth starts another); a member, where every member holds the whole state
        (DDP), is left out of the next generation, which the survivors form without it."""
        if lost.from_code:
            return False
        if lost.name in self.joining:
            self.joining.remove(lost.name)
            return True
        if lost.rank is None:
            return True
        if len(self.keeper.current.members) < 2 or self.spec.parallelism.strategy != "ddp":
            return False
        self._change(leave=[lost.name])
        return True

    def _change(self, leave: Sequence[str] = (), join: Sequence[str] = ()) -> None:
        new = self.keeper.change(leave=leave, join=join)
        log_event(self.spec.run_uri, Event.GROUP_CHANGE, generation=new.number, leaving=list(leave),
                  joining=list(join), world_size=len(new.members))

    def stop(self) -> None:
        for name in list(self.workers):
            self._end(name)


def room_for(placement: WorkerPlacement, available: dict[str, float]) -> int:
    """How many more workers Ray's free resources hold."""
    return min((math.floor(available.get(key, 0.0) / need) for key, need in placement.resources.items() if need > 0),
               default=1 << 30)


def starting_size(spec: JobSpec, placement: WorkerPlacement, available: dict[str, float]) -> int:
    """scaling.num_workers; in an elastic range, the most workers the cluster has room for now (at
    least min_workers: the rest wait for room)."""
    sizes = spec.scaling.world_sizes
    return max(sizes[0], min(sizes[-1], room_for(placement, available)))


class RoomToGrow:
    """The size an elastic group of `shardyard train` is asked to have: the workers it has and is
    starting, and as many more as Ray's free resources hold (a node joined, a lost worker's
    resources freed), up to max_workers; looked at every scaling.resize_check_interval_s. Never
    less than it has: workers leave only when lost."""

    def __init__(self, spec: JobSpec, placement: WorkerPlacement) -> None:
        self.spec, self.placement = spec, placement
        self.looked_at, self.wanted = -math.inf, 0

    def __call__(self, group: InPlaceGroup) -> int:
        now = time.monotonic()
        if now - self.looked_at >= self.spec.scaling.resize_check_interval_s:
            self.looked_at = now
            have = group.size + len(group.joining)
            self.wanted = min(self.spec.scaling.world_sizes[-1], have + room_for(self.placement, ray.available_resources()))
        return max(group.size, self.wanted)


def follow(spec: JobSpec, placement: WorkerPlacement, config: dict[str, Any], size: int,
           allotment: Callable[[], int] | None) -> None:
    """Start the group and, until the run ends, keep it at the size asked for; go on without a lost
    worker where the group can (a replacement then joins), else restart the group from the newest
    checkpoint (up to scaling.max_failures times). Whatever stops this stops the group's workers."""
    def start(workers: int) -> InPlaceGroup:
        return InPlaceGroup(spec, placement, config | {"startup": config["startup"] | {"fit_at": time.time()}},
                            workers)

    group, failures = start(size), 0
    elastic = len(spec.scaling.world_sizes) > 1
    room = RoomToGrow(spec, placement)
    try:
        while True:
            wanted = allotment() if allotment is not None else room(group) if elastic else size
            try:
                if group.wait(POLL_S):
                    return
                if wanted != group.size:
                    group.resize(wanted)
            except WorkerFailed as err:
                ranks = [] if err.rank is None else [err.rank]
                log_event(spec.run_uri, Event.FAILURE, ranks=ranks, errors={str(r): str(err) for r in ranks},
                          from_code=err.from_code, lost=[] if err.from_code else ranks)
                if group.leave_out(err):
                    print(f"shardyard: worker lost ({err}); the group goes on without it", file=sys.stderr,
                          flush=True)
                    continue
                group.stop()
                failures += 1
                allowed, step = spec.scaling.max_failures, newest_step(RunStorage(spec.run_uri))
                if allowed != -1 and failures > allowed:
                    raise RunGaveUp(f"run '{spec.run.name}' stopped: {err}; scaling.max_failures "
                                    f"({restarts_allowed(allowed)}) restarts were used. Launching it again resumes "
                                    f"from step {step}") from None
                print(f"shardyard: worker lost ({err}); restarting from step {step} ({failures} of "
                      f"{restarts_allowed(allowed)})", file=sys.stderr, flush=True)
                group = start(wanted)
    finally:
        group.stop()


def fit_in_place(spec: JobSpec, lease: RunLease, can_grow: bool, startup: dict[str, float],
                 fault_injection: dict[str, Any], allotment: Callable[[], int] | None = None) -> RunResult:
    """Train `spec` as an in-place group, connected to Ray and holding the run's `lease`, at the
    size `allotment()` says (the pool's), or at scaling.num_workers; raise RunGaveUp or Preempted
    as the launch's events say it ended."""
    launch_id = uuid.uuid4().hex
    placement = place_workers(spec, ray.cluster_resources(), can_grow)
    if placement.reason:
        print(f"shardyard: {placement.reason}", file=sys.stderr, flush=True)
    log_event(spec.run_uri, Event.LAUNCH, id=launch_id, lease_generation=lease.generation)
    config = {"launch_id": launch_id, "lease_generation": lease.generation, "lease_id": lease.id,
              "lease_base_step": lease.base_step, "use_gpu": placement.use_gpu, "startup": startup,
              "progress_bar": sys.stdout.isatty(), "hold_at": fault_injection["hold_at"]}
    size = allotment() if allotment is not None else starting_size(spec, placement, ray.available_resources())
    start = time.perf_counter()
    stop_if_terminated()
    with preemption_notice(spec) as notice:
        try:
            follow(spec, placement, config, size, allotment)
        except StoppedAtOnce:
            raise StoppedAtOnce(stopped_at_once(spec)) from None
    return launch_result(spec, launch_id, notice.by,
                         f"shardyard run '{spec.run.name}' ({spec.parallelism.strategy}, resized in place)", start)
