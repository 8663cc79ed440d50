"""An elastic group of local processes without Ray: a keeper in the test's process, each worker a
process of its own that the test starts, tells to leave and lets join, at hold points."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardyard.localdist import PRELOAD
from shardyard.spec import parse_spec
from shardyard.storage.events import Event, read_events
from shardyard.train.callbacks import Callback, HoldAtSteps, LedgerCallback, held_at, release
from shardyard.train.elastic_group import Roster, RosterKeeper
from shardyard.train.trainer import Trainer

FINAL = "final.pt"  # the final group's rank 0 writes the whole model's weights here


class FailsAt(Callback):
    """The training code's own error (a RuntimeError, as most of torch's are) after a step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Trainer) -> None:
        if trainer.state.step == self.step:
            raise RuntimeError(f"the training code failed at step {self.step}")


def worker(name: str, address: str, raw: dict[str, Any], holds: list[int], out: str,
           fail_at: int | None = None) -> None:
    """One worker's life: wait to be named in a generation, form its group, train (joining a
    running group if it is not in the first), and end when it leaves or the run ends; with
    `fail_at`, its training code fails after that step."""
    torch.set_num_threads(1)  # several processes share the machine's cores
    roster = Roster(address, name)
    generation = roster.wait_for_membership()
    roster.form(generation, "gloo")
    spec = parse_spec(raw)
    callbacks = [LedgerCallback(spec.run_uri, name, roster.attempt), HoldAtSteps(holds)]
    callbacks += [FailsAt(fail_at)] if fail_at is not None else []
    trainer = Trainer.build(spec, dist.get_rank(), dist.get_world_size(), torch.device("cpu"),
                            callbacks=callbacks, roster=roster)
    trainer.train(join=generation.number > 0)
    if not trainer.left:
        weights = trainer.engine.full_state_dict()
        if dist.get_rank() == 0:
            torch.save(weights, Path(out, FINAL))
        dist.destroy_process_group()


class LocalGroup:
    """The test's side: the keeper, and the workers' processes by name."""

    def __init__(self, members: list[str], raw: dict[str, Any], holds: list[int], out: Path,
                 fail_at: dict[str, int] | None = None) -> None:
        self.raw, self.holds, self.out, self.fail_at = raw, holds, out, fail_at or {}
        self.run = Path(raw["checkpoint"]["storage_path"], raw["run"]["name"])
        self.keeper = RosterKeeper(members)
        # Forked from a server that imported torch and the Trainer once, as localdist's ranks are.
        self.context = mp.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)
        self.processes = {name: self._start(name) for name in members}

    def _start(self, name: str) -> mp.Process:
        process = self.context.Process(target=worker, name=name,
                                       args=(name, self.keeper.address, self.raw, self.holds, str(self.out),
                                             self.fail_at.get(name)))
        process.start()
        return process

    def at_hold(self, step: int, leave: list[str] = (), join: list[str] = ()) -> None:
        """Once the run holds at `step`: start the joiners, wait until they are ready, publish the
        change, let the run go on (it changes at its next step boundary)."""
        wait_for(lambda: held_at(self.run, step) is not None, f"the run to hold at step {step}")
        for name in join:
            self.processes[name] = self._start(name)
            wait_for(lambda: self.keeper.is_ready(name), f"worker {name} to start")
        self.keeper.change(leave=leave, join=join)
        release(self.run, step)

    def lose_at_hold(self, step: int, name: str) -> None:
        """Once the run holds at `step`: kill worker `name` (SIGKILL), as the driver would publish
        the generation without it, then let the run go on (its survivors' next collective fails)."""
        wait_for(lambda: held_at(self.run, step) is not None, f"the run to hold at step {step}")
        self.processes[name].kill()
        self.processes[name].join()
        self.keeper.change(leave=[name])
        release(self.run, step)

    def finish(self, timeout_s: float = 120) -> dict[str, int]:
        """Every worker's exit code, once all have ended."""
        for process in self.processes.values():
            process.join(timeout_s)
        codes = {name: process.exitcode for name, process in self.processes.items()}
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
        return codes

    def regroups(self) -> list[dict[str, Any]]:
        return [e for e in read_events(self.run) if e["event"] == Event.REGROUPED]


def wait_for(condition, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.05)

