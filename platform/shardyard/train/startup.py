"""How long a launch takes from the command to its first step, phase by phase: starting Ray (or
joining it), starting the workers, building the model and engine, choosing and verifying the
checkpoint, loading it, and the first step itself. Rank 0 logs them as a `first_step` event; the
driver prints them and adds them to the end-of-run table, so a slow restart says where it went.

The command's start is its process's start (Python's own imports counted, as a user's watch
counts them); worker times are rank 0's wall clock against the driver's, equal on one machine and
as close as the nodes' clocks elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Any

import psutil

from shardyard.storage.events import Event, log_event
from shardyard.train.trainer import Callback, Trainer

PHASES = {"command_s": "command", "ray_start_s": "Ray", "worker_start_s": "workers", "build_s": "build",
          "verify_s": "verify", "load_s": "load", "first_step_s": "first step"}


def driver_marks(ray_started_at: float, ray_start_s: float, began_at: float | None = None) -> dict[str, float]:
    """What the driver knows, for the workers: when the command started (`command_s`: its imports,
    the spec, the lease and the preflight, up to starting Ray at `ray_started_at`), how long Ray
    took, and when the worker group was asked for (now). `began_at`: when this launch began, where
    it is not the process's start (the pool relaunching its run at another size)."""
    command_at = psutil.Process().create_time() if began_at is None else began_at
    return {"command_at": command_at, "command_s": ray_started_at - command_at, "ray_start_s": ray_start_s,
            "fit_at": time.time()}


class StartupPhases(Callback):
    """Rank 0 logs the launch's start-up phases once its first step has ended. `entered_at`: when
    the worker function began."""

    def __init__(self, launch_id: str, marks: dict[str, float], entered_at: float) -> None:
        self.launch_id = launch_id
        self.marks = marks
        self.entered_at = entered_at

    def on_first_step(self, trainer: Trainer) -> None:
        if trainer.rank != 0:
            return
        phases = {"command_s": self.marks["command_s"], "ray_start_s": self.marks["ray_start_s"],
                  "worker_start_s": self.entered_at - self.marks["fit_at"], **trainer.timings}
        log_event(trainer.spec.run_uri, Event.FIRST_STEP, launch=self.launch_id, step=trainer.state.step,
                  since_command_s=time.time() - self.marks["command_at"], **phases)


def report(event: dict[str, Any] | None) -> dict[str, float]:
    """Print a launch's `first_step` event as one line; its phases, for the end-of-run table."""
    if event is None:
        return {}
    parts = ", ".join(f"{label} {event[key]:.1f} s" for key, label in PHASES.items() if key in event)
    print(f"shardyard: first step {event['since_command_s']:.1f} s after the command ({parts})",
          file=sys.stderr, flush=True)
    return {"to_first_step_s": event["since_command_s"], **{key: event[key] for key in PHASES if key in event}}
