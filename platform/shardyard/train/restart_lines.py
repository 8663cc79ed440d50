"""One line on the driver's console for every worker failure, restart and resize of a launch,
read from the run's events as Ray Train's controller and the workers write them (`failure`,
`start`): the user sees "worker lost ... restarting from step 800 (1 of 3)" where Ray prints its
tracebacks, and what a launch that ran out of restarts resumes from."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from shardyard.storage.events import Event, read_events
from shardyard.checkpoint.record import newest_step
from shardyard.storage.store import RunStorage

POLL_S = 2.0  # how often the events are read: a failure is said within this of being recorded


def restarts_allowed(max_failures: int) -> str:
    return "unlimited" if max_failures < 0 else str(max_failures)


def failure_line(event: dict[str, Any], failures: int, max_failures: int, resumes_from: int) -> str:
    """`shardyard: worker lost (rank 1: WorkerHealthCheckFailedError: ...); restarting from step
    800 (1 of 3)`. The cause named is a lost worker's (Ray's error) where there is one: the
    others' errors (a collective whose peer vanished) follow from it."""
    errors = {int(rank): error for rank, error in event.get("errors", {}).items()}
    lost = [rank for rank in event.get("lost", []) if rank in errors]
    rank = (lost or sorted(errors) or [None])[0]
    cause = f"rank {rank}: {errors[rank].splitlines()[0][:160]}" if rank is not None else "no error given"
    what = ("worker lost" if len(lost) == 1 else f"{len(lost)} workers lost") if lost else "training failed"
    if 0 <= max_failures < failures:
        return f"shardyard: {what} ({cause}); no restart left (scaling.max_failures {max_failures})"
    return (f"shardyard: {what} ({cause}); restarting from step {resumes_from} "
            f"({failures} of {restarts_allowed(max_failures)})")


def start_line(event: dict[str, Any], previous: dict[str, Any]) -> str:
    """A worker group after the launch's first: `training again on 2 workers from step 800 (11.2 s
    after the failure)`, or a resize."""
    workers, before = event["world_size"], previous["world_size"]
    size = f"{before} -> {workers} workers" if workers != before else f"{workers} worker{'s' if workers != 1 else ''}"
    after = f" ({event['downtime_s']:.1f} s after the failure)" if event.get("downtime_s") is not None else ""
    return f"shardyard: training again on {size} from step {event['restored_step']}{after}"


@contextmanager
def restart_lines(run_uri: str, launch_id: str, max_failures: int) -> Iterator[None]:
    """While the block runs (the launch's Ray Train run), say each failure and each worker group
    after the first as the events come in."""
    stop = threading.Event()

    def watch() -> None:
        seen, failures, last_start = 0, 0, None
        while True:
            stopping = stop.wait(POLL_S)
            events = read_events(run_uri)
            began = max((i for i, e in enumerate(events) if e["event"] == Event.LAUNCH and e.get("id") == launch_id),
                        default=len(events))
            for event in events[max(began, seen):]:
                if event["event"] == Event.FAILURE:
                    failures += 1
                    print(failure_line(event, failures, max_failures, newest_step(RunStorage(run_uri))),
                          file=sys.stderr, flush=True)
                elif event["event"] == Event.START:
                    if last_start is not None:
                        print(start_line(event, last_start), file=sys.stderr, flush=True)
                    last_start = event
            seen = len(events)
            if stopping:
                return

    watcher = threading.Thread(target=watch, name="shardyard-restart-lines", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join(timeout=30)
