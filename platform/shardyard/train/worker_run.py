"""What a launch's worker does around its Trainer, whichever group it is in (a Ray Train worker,
a member of an in-place group): the callbacks the launch attaches, and the training itself with
the event its end leaves in the run's log."""

from __future__ import annotations

from typing import Any

from shardyard.checkpoint.lease import LeaseLost
from shardyard.spec import JobSpec
from shardyard.storage.events import Event, log_event
from shardyard.train.callbacks import CrashAtCheckpoint, HoldAtSteps, LedgerCallback, RunEvents
from shardyard.train.startup import StartupPhases
from shardyard.train.step_guard import Diverged
from shardyard.train.trainer import Callback, Trainer


def launch_callbacks(spec: JobSpec, config: dict[str, Any], entered_at: float,
                     ledger: tuple[str, float] | None) -> list[Callback]:
    """The event log, the start-up phases, the sample ledger (`ledger`: this worker's writer name
    and its group's attempt, where the run keeps one), the fault injection the launch was given
    (`config`'s crash_at_checkpoint and hold_at) and the weights publisher."""
    callbacks: list[Callback] = [RunEvents(), StartupPhases(config["launch_id"], config["startup"], entered_at)]
    if spec.run.sample_ledger and ledger is not None:
        callbacks.append(LedgerCallback(spec.run_uri, *ledger))
    if config.get("crash_at_checkpoint") is not None:
        callbacks.append(CrashAtCheckpoint(config["crash_at_checkpoint"]))
    if config["hold_at"]:
        callbacks.append(HoldAtSteps(config["hold_at"]))
    if spec.checkpoint.publish_to is not None:
        from shardyard.train.publish import WeightsPublisher  # Serve, for runs that publish only

        callbacks.append(WeightsPublisher(spec.checkpoint.publish_to,
                                          spec.checkpoint.publish_every_n_steps or spec.checkpoint.every_n_steps))
    return callbacks


def train_to_end(trainer: Trainer, launch_id: str, join: bool = False) -> bool:
    """Train (`join`: as Trainer.train); rank 0 logs how the group's run stopped, if it stopped
    early. False if it stopped on a lost lease or a diverged loss (every rank raised it at the same
    step: the group ends here)."""
    spec = trainer.spec
    try:
        trainer.train(join=join)
    except (LeaseLost, Diverged) as err:
        if trainer.rank == 0:
            kind = Event.LEASE_LOST if isinstance(err, LeaseLost) else Event.DIVERGED
            log_event(spec.run_uri, kind, launch=launch_id, reason=str(err), step=trainer.state.step)
        return False
    if trainer.preempted and trainer.rank == 0:
        log_event(spec.run_uri, Event.PREEMPTED, launch=launch_id, step=trainer.state.step)
    return True
