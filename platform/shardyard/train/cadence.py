"""A run's rhythm, one for every way of training: which steps write a metrics row, evaluate and
checkpoint, what the row's rate is, and that the row is written before the checkpoint of its step
commits (a run resumed from that checkpoint has the row). The Trainer steps through it once per
step; the parameter-server driver once for each step its servers completed, several per report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardyard.spec import JobSpec
from shardyard.train.metrics import MetricsLog, Progress, Throughput


def checkpoint_scheduled(spec: JobSpec, step: int) -> bool:
    """Whether `step` checkpoints by schedule (every `checkpoint.every_n_steps` and the last step;
    a preemption or a drain adds others)."""
    return step == spec.run.steps or step % spec.checkpoint.every_n_steps == 0


@dataclass(frozen=True)
class Due:
    checkpoint: bool
    evaluate: bool
    row: bool  # a metrics row (every checkpoint and evaluation has one)


class Cadence:
    def __init__(self, spec: JobSpec, first_step: int, writes: bool, progress_bar: bool) -> None:
        """`first_step`: the step the run resumes after; `writes`: this process writes the rows
        (rank 0, the driver)."""
        self.spec = spec
        self.log = MetricsLog(spec, first_step) if writes else None
        self.progress = Progress(spec.run.steps, first_step, progress_bar) if writes else None
        self.throughput = Throughput()
        self.last_row = first_step

    def stepped(self, samples: int, tokens: int) -> None:
        """A step of `samples` (`tokens`) completed: what the next rate counts."""
        self.throughput.add(samples, tokens)

    def since_row(self, step: int) -> int:
        """Steps since the last row, up to `step`: what a row's mean loss spans."""
        return step - self.last_row

    def due(self, step: int, *, checkpoint_now: bool = False, can_evaluate: bool = False) -> Due:
        """What `step` does besides training. `checkpoint_now`: a checkpoint off the schedule
        (preemption, a node being drained); `can_evaluate`: the run has validation data."""
        checkpoint = checkpoint_now or checkpoint_scheduled(self.spec, step)
        evaluate = can_evaluate and (step == self.spec.run.steps or step % self.spec.eval.every_n_steps == 0)
        return Due(checkpoint, evaluate, checkpoint or evaluate or step % self.spec.run.log_every == 0)

    def rate(self) -> dict[str, float]:
        """Samples and tokens a second of the steps since the last read."""
        return self.throughput.read()

    def pause_clock(self) -> None:
        """What ran since the last step (an evaluation) is not training time."""
        self.throughput.restart()

    def record(self, row: dict[str, Any]) -> None:
        """The row of the step just due (`row["step"]`): before its checkpoint, if it has one."""
        if self.log is not None:
            self.log.append(row)
            self.progress.update(self.since_row(row["step"]), row)
        self.last_row = row["step"]

    def close(self) -> None:
        if self.log is not None:
            self.progress.close()
            self.log.close()
