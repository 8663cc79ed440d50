"""How a launch ends when it does not finish: the exceptions the driver raises (their messages are
what the user reads) and the reading of a launch's events that decides it should not retry."""

from __future__ import annotations

from typing import Any

from shardyard.spec import JobSpec
from shardyard.storage.events import Event, launch_end, read_events
from shardyard.train.metrics import RunResult, finish_run
from shardyard.train.startup import report


class RunGaveUp(RuntimeError):
    """The run stopped and retrying would not help: it failed the same way twice from the same
    checkpoint, its loss diverged, or another launch took it over."""


class Preempted(RuntimeError):
    """A preemption notice stopped the run after it committed a checkpoint: launching it again
    continues. `by`: the signal to this driver that gave the notice (SIGTERM, or Ctrl-C), or None
    for one written by another part of shardyard (the pool resizing the run)."""

    def __init__(self, message: str, by: str | None) -> None:
        super().__init__(message)
        self.by = by

    @property
    def signalled(self) -> bool:
        return self.by is not None


def repeated_failure(events: list[dict[str, Any]], launch_id: str) -> str | None:
    """Why this launch should not start another worker group: its last two failed groups raised
    the same errors from their training code after restoring the same step. A deterministic error
    fails again however often `scaling.max_failures` retries it; a lost process or node (Ray's
    errors) and an error after progress are retried as before."""
    start = max((i for i, e in enumerate(events) if e["event"] == Event.LAUNCH and e.get("id") == launch_id), default=0)
    step, failed = None, []
    for event in events[start:]:
        if event["event"] == Event.START:
            step = event["restored_step"]
        elif event["event"] == Event.FAILURE:
            failed.append((step, sorted(set(event["errors"].values())), event.get("from_code", False)))
    if len(failed) < 2 or failed[-1] != failed[-2] or not failed[-1][2]:
        return None
    step, errors, _ = failed[-1]
    return (f"the same error twice from {f'step {step}' if step else 'the start'} with no progress, so not "
            f"retried again (scaling.max_failures): {'; '.join(errors)}")


def first_line(err: BaseException, limit: int) -> str:
    return (str(err).strip().splitlines() or [""])[0][:limit]


def failure_summary(err: Exception) -> str:
    """Ray Train's final error in a line: each failed rank's error, first line only; or the error
    that stopped Ray Train's controller (its own message says only that on its first line)."""
    failures = getattr(err, "worker_failures", None) or {}
    cause = getattr(err, "controller_failure", None)
    if cause is not None:
        return f"Ray Train's controller failed: {type(cause).__name__}: {first_line(cause, 240)}"
    if not failures:
        return first_line(err, 300) or type(err).__name__
    return "; ".join(f"rank {rank}: {type(e).__name__}: {first_line(e, 160)}" for rank, e in sorted(failures.items()))


def launch_result(spec: JobSpec, launch_id: str, notice_by: str | None, title: str, started: float) -> RunResult:
    """How launch `launch_id` ended, read from its events once its workers are done: the run's
    result (its start-up phases and end-of-run table printed), or RunGaveUp or Preempted.
    `notice_by`: the signal that gave a preemption notice, if one did."""
    ended = launch_end(read_events(spec.run_uri), launch_id)
    startup = report(ended.first_step)
    if ended.stopped is not None:
        raise RunGaveUp(f"run '{spec.run.name}' stopped: {ended.stopped['reason']}")
    if ended.preempted_at is not None:
        raise Preempted(f"run '{spec.run.name}' stopped on {notice_by or 'a preemption notice'} after committing "
                        f"step {ended.preempted_at}; launch it again to continue from there", notice_by)
    return finish_run(spec, title, started, startup)
