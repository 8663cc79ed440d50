"""The training loop, as one Ray-agnostic object (the shape of TorchTitan's `Trainer`).

`Trainer.build` makes the engine (the strategy), the dataset and its global sample order, and the
checkpoint manager from a job spec and a process's place in the world; `train()` restores the
newest committed checkpoint and runs steps until `run.steps`, logging and checkpointing on the
spec's intervals. It needs an initialised torch.distributed process group and nothing else: Ray
Train's workers build it (train/ray_train/worker.py), and tests build it in plain torch.distributed
processes. What varies between runs attaches as callbacks (train/callbacks.py): the sample
ledger, the event log, fault injection. In an elastic group (train/elastic_group.py) the group
may change at a step boundary: workers leave and join, and the loop goes on at the new size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist

from shardyard.data import (Dataset, UserStream, build_dataset, build_validation, micro_batch_ids, sample_order,
                            validation_order)
from shardyard.models import build_for_job, metrics_fn_for
from shardyard.parallel import Engine, build_engine
from shardyard.layout.world_size import at_world_size
from shardyard.planner import ModelShape
from shardyard.spec import LANGUAGE_MODELS, JobSpec, ModuleSpec
from shardyard.storage.events import Event, log_event
from shardyard.checkpoint.manager import CheckpointManager, Fence
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.lease import LeaseLost
from shardyard.checkpoint.pretrained import pretrained_weights
from shardyard.train.efficiency import device_peak_flops, flops_per_token, module_flops_per_sample, peak_memory_bytes
from shardyard.train.cadence import Cadence, Due, checkpoint_scheduled
from shardyard.train.elastic_group import Held, Roster, hand_over, take_over
from shardyard.train.step_guard import Diverged, StepGuard


class Callback:
    """Hooks the Trainer calls on every rank; each does nothing unless overridden."""

    def on_train_start(self, trainer: Trainer) -> None: ...

    def on_step_start(self, trainer: Trainer, ids: list[torch.Tensor]) -> None:
        """Before step `trainer.state.step + 1` runs on this rank's micro-batches `ids`."""

    def on_step_end(self, trainer: Trainer) -> None:
        """Step `trainer.state.step` was applied."""

    def on_healed(self, trainer: Trainer, from_step: int) -> None:
        """The engine replaced this rank's state with a live peer's (hot recovery)."""

    def on_first_step(self, trainer: Trainer) -> None:
        """This worker's first step since it started ended (`trainer.timings` holds its start-up)."""

    def on_checkpoint_start(self, trainer: Trainer) -> None: ...

    def on_checkpoint_end(self, trainer: Trainer) -> None: ...

    def on_train_end(self, trainer: Trainer) -> None: ...


class Trainer:
    def __init__(self, spec: JobSpec, written: JobSpec, engine: Engine, dataset: Dataset | UserStream,
                 checkpoints: CheckpointManager, rank: int, world_size: int,
                 callbacks: Sequence[Callback] = (), progress_bar: bool = False,
                 validation: Dataset | UserStream | None = None, fence: Fence | None = None,
                 node_drained: Callable[[], bool] | None = None, roster: Roster | None = None) -> None:
        self.spec = spec            # the spec as it runs at this world size
        self.written = written      # the spec as the user wrote it: what checkpoints record
        self.engine = engine
        self.dataset = dataset
        self.validation = validation  # evaluated every eval.every_n_steps, when given
        self.metrics = metrics_fn_for(spec)
        if isinstance(validation, Sized) and len(validation) < spec.batch.global_batch_size:  # shards: by preflight
            raise ValueError(f"eval.every_n_steps: the validation split holds {len(validation)} samples, fewer "
                             f"than one global batch ({spec.batch.global_batch_size})")
        self.checkpoints = checkpoints
        self.rank, self.world_size = rank, world_size
        self.callbacks = list(callbacks)
        self.progress_bar = progress_bar
        self.order = sample_order(dataset, spec.run.seed)
        self.state = TrainState(world_size=world_size)
        self.restored: TrainState | None = None  # what train() resumed from, if anything
        self.restore_s = 0.0
        # Seconds of this worker's start-up, phase by phase (train/startup.py reports them).
        self.timings: dict[str, float] = {}
        # Summed on the device between reports: reading a loss each step would sync a GPU.
        self._loss_sum = torch.zeros((), device=engine.device)
        self._last_loss = torch.zeros((), device=engine.device)
        self.roster = roster  # this worker's view of its elastic group; None in a fixed one
        self.guard = StepGuard(spec.run_uri, rank, engine.device, fence, spec.checkpoint.lease_ttl_s / 3, node_drained,
                               newest_generation=roster.newest if roster is not None else None)
        self.preempted = False  # set when a preemption notice ended train() early, after a checkpoint
        self.left = False  # set when this worker left its elastic group (train() ended there)
        self.cadence: Cadence | None = None  # train()'s rhythm of rows and checkpoints
        self._drain_saved = False  # the drain under way of a worker's node has its checkpoint
        self._adopt(engine)
        self.tokens_per_sample = spec.model.block_size if isinstance(spec.model, LANGUAGE_MODELS) else 1
        if isinstance(spec.model, ModuleSpec):
            self.flops_per_token = module_flops_per_sample(spec.model, dataset)
        else:
            shape = ModelShape.of(spec)
            self.flops_per_token = flops_per_token(shape.total, shape.n_layer, shape.n_embd,
                                                   self.tokens_per_sample if shape.n_embd else 0)
        self.peak_flops = device_peak_flops(engine.device, spec.run.peak_tflops)

    def _adopt(self, engine: Engine) -> None:
        """`engine` trains from now on (a new one each time an elastic group changes)."""
        self.engine = engine
        engine.skip_nonfinite = self.spec.run.on_nonfinite == "skip"
        if self.roster is not None:  # the sample ledger tells the generations apart
            engine.step_round = self.roster.current.number

    @classmethod
    def build(cls, written: JobSpec, rank: int, world_size: int, device: torch.device, *,
              callbacks: Sequence[Callback] = (), checkpoint_writer: bool = True,
              fence: Fence | None = None, node_drained: Callable[[], bool] | None = None, replica_id: str = "",
              progress_bar: bool = False, roster: Roster | None = None) -> Trainer:
        """`written` is the validated spec; at this world size the pipeline mesh may be re-planned
        and (if the spec allows it) the global batch changed. `fence` raises once this launch no
        longer holds the run's lease (checkpoint/lease.py); `node_drained`, collective, says whether
        a worker's node is about to be reclaimed (the run then checkpoints at once and trains on).
        `roster`: this worker's elastic group, its process group already formed."""
        start = time.perf_counter()
        spec = at_world_size(written, world_size)
        # Same seed on every rank: identical initial weights, as a single process would build them
        # (or a model directory's, read by each rank where its part lies).
        torch.manual_seed(spec.run.seed)
        weights = pretrained_weights(spec.model)
        engine = build_engine(spec, build_for_job(spec, weights), device, replica_id=replica_id, weights=weights)
        checkpoints = CheckpointManager(spec.run_uri, spec.checkpoint.keep, asynchronous=spec.checkpoint.async_write,
                                        writer=checkpoint_writer, load_optimizer=spec.checkpoint.load_optimizer,
                                        fence=fence, spec=written)
        trainer = cls(spec, written, engine, build_dataset(spec), checkpoints, rank, world_size, callbacks,
                      progress_bar, build_validation(spec), fence, node_drained, roster)
        trainer.timings["build_s"] = time.perf_counter() - start
        return trainer

    @property
    def global_batch(self) -> int:
        return self.spec.batch.global_batch_size

    def restore(self) -> None:
        """Collective: resume from the run's newest committed checkpoint, if there is one."""
        start = time.perf_counter()
        self.restored = self.checkpoints.restore(self.engine)
        self.restore_s = time.perf_counter() - start
        self.timings |= self.checkpoints.restore_timings
        if self.restored is not None:
            self.state = TrainState(self.restored.step, self.restored.samples_seen, self.world_size)

    def train_step(self) -> bool:
        """One optimizer step on the next global batch. False if the engine could not apply it
        (a replica was lost mid-step): the same step is then run again."""
        step_before = self.state.step
        self.engine.begin_step(self.state)
        if self.state.step != step_before:
            for callback in self.callbacks:
                callback.on_healed(self, step_before)
        # The data-parallel size may change from step to step (hot recovery); the global batch not.
        micro = self.spec.batch.micro_batch_size
        accum = self.global_batch // (micro * self.engine.dp_size)
        ids = micro_batch_ids(self.order, self.state.samples_seen, self.engine.dp_rank, self.engine.dp_size,
                              micro, accum)
        for callback in self.callbacks:
            callback.on_step_start(self, ids)
        loss = self.engine.train_step([self.dataset.batch(i) for i in ids])
        if loss is None:
            return False
        self._last_loss = loss
        if self.engine.skipped:  # run.on_nonfinite: skip; the step's update was not applied
            if self.rank == 0:
                log_event(self.spec.run_uri, Event.SKIPPED_NONFINITE, step=self.state.step + 1)
        else:
            self._loss_sum += loss / self.engine.loss_ranks  # a step's mean over the ranks of its group
        self.state.step += 1
        self.state.samples_seen += self.global_batch
        for callback in self.callbacks:
            callback.on_step_end(self)
        return True

    def train(self, until: int | None = None, join: bool = False) -> TrainState:
        """Collective: restore, then train to `run.steps`, or stop after step `until` as if
        interrupted there (the schedule still spans `run.steps`). `join`: this worker joins a
        running elastic group, taking its state from a live peer instead of storage."""
        last_row = None  # where the group's last metrics row was, for a worker that joins it
        if join:
            last_row = self._take_state(None)
        else:
            self.restore()
        for callback in self.callbacks:
            callback.on_train_start(self)
        self.cadence = Cadence(self.spec, self.state.step, self.rank == 0, self.progress_bar)
        if last_row is not None:
            self.cadence.last_row = last_row
        last = self.spec.run.steps if until is None else min(until, self.spec.run.steps)
        self._first_step_at = time.perf_counter()
        while self.state.step < last:
            try:
                if self._advance():
                    break
            except RuntimeError as err:  # a collective failed: a member of an elastic group may be lost
                if not self._regroup_after_loss(err):
                    raise
        self.checkpoints.close()
        self.engine.close()
        for callback in self.callbacks:
            callback.on_train_end(self)
        self.cadence.close()
        return self.state

    def _advance(self) -> bool:
        """Collective: one step and what follows it at its boundary. True: the loop stops here."""
        cadence = self.cadence
        if not self.train_step():
            return False
        if "first_step_s" not in self.timings:
            self.timings["first_step_s"] = time.perf_counter() - self._first_step_at
            for callback in self.callbacks:
                callback.on_first_step(self)
        cadence.stepped(self.global_batch, self.global_batch * self.tokens_per_sample)
        step = self.state.step
        verdict = self.guard.check(self._last_loss, self.engine.grad_norm)
        if verdict.lease_lost is not None:
            raise LeaseLost(verdict.lease_lost)
        if verdict.nonfinite and not self.engine.skipped:
            raise Diverged.at(step, "the loss or gradient norm is", can_skip=True)
        self.preempted = verdict.preempt
        drain_save = bool(verdict.drained) and not self._drain_saved
        if verdict.drained is not None:  # the cluster was asked at this step
            self._drain_saved = verdict.drained
        if drain_save and self.rank == 0:
            log_event(self.spec.run_uri, Event.DRAIN_CHECKPOINT, step=step)
        due = cadence.due(step, checkpoint_now=self.preempted or drain_save, can_evaluate=self.validation is not None)
        if due.row:
            self._row(cadence, due)
        if self.preempted:
            return True
        changed = verdict.generation is not None and verdict.generation != self.roster.current.number
        return changed and not self._regroup(verdict.generation)

    def _row(self, cadence: Cadence, due: Due) -> None:
        """Collective: the step's metrics row; its evaluation and checkpoint when due."""
        step = self.state.step
        metrics = {**self._mean_loss(cadence.since_row(step)), "lr": self.engine.lr, "world_size": self.world_size,
                   "global_batch": self.global_batch, "samples_seen": self.state.samples_seen,
                   **self._epoch(), **cadence.rate()}
        metrics |= self._efficiency(metrics["tokens_per_s"])
        if due.evaluate:
            metrics |= self.evaluate()
            cadence.pause_clock()
        cadence.record(metrics)
        if due.checkpoint:
            for callback in self.callbacks:
                callback.on_checkpoint_start(self)
            self.checkpoints.save(self.engine, self.state, self.written)
            for callback in self.callbacks:
                callback.on_checkpoint_end(self)

    def _regroup_after_loss(self, err: RuntimeError) -> bool:
        """After a failed collective in an elastic group whose members each hold the whole state
        (DDP): once the driver has left the lost member out of a new generation, the survivors go
        on in it from the first survivor's state. False where that cannot be (the error stands)."""
        if self.roster is None or not self.engine.whole_replicas:
            return False
        number = self.roster.wait_for_change(after=self.roster.current.number, members=self.roster.current.members)
        if number is None:  # no member was lost: the error was something else
            return False
        reason = str(err).splitlines()[0].split("] ", 1)[-1][:120]  # gloo's message, past its source location
        print(f"shardyard: a collective failed ({reason}); going on in generation {number}", flush=True)
        return self._regroup(number, lost=True)

    def _regroup(self, number: int, lost: bool = False) -> bool:
        """Collective over the old group (unless a member was `lost`: it is broken), then over the
        new: the elastic group becomes generation `number` at this step boundary. The first member
        that stays holds the state; every old member ends the old process group; the new
        generation's members form theirs, build the engine at the new size and take the state from
        its rank 0 (that member). False: this worker is not in the new generation and stops here."""
        began = time.perf_counter()
        old, new = self.roster.current, self.roster.generation(number)
        holder = next(rank for rank, name in enumerate(old.members) if name in new.members)
        backend = dist.get_backend()
        if not lost:
            self.checkpoints.wait()  # a write under way commits in the group that made it
            dist.all_reduce(self._loss_sum)  # the losses of the row under way: kept by the holder alone
        held = hand_over(self.engine, holder, alone=lost)
        if self.rank != holder:  # (after a loss the holder's share alone: that row's loss is approximate)
            self._loss_sum.zero_()
        self.engine.close()
        dist.destroy_process_group()
        self.checkpoints.group_ended()
        if self.roster.name not in new.members:
            self.left = True
            return False
        self.roster.form(new, backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.spec = at_world_size(self.written, self.world_size)
        self.guard.rank = self.rank
        torch.manual_seed(self.spec.run.seed)  # weights drawn only to be replaced by the holder's
        self._adopt(build_engine(self.spec, build_for_job(self.spec, None), self.engine.device))
        self._take_state(held)
        if self.rank == 0 and self.cadence.log is None:  # the old rank 0 left: this member writes now
            writer = Cadence(self.spec, self.state.step, True, self.progress_bar)
            writer.last_row, writer.throughput = self.cadence.last_row, self.cadence.throughput
            self.cadence = writer
        if self.rank == 0:
            log_event(self.spec.run_uri, Event.REGROUPED, generation=number, members=list(new.members),
                      world_size=self.world_size, step=self.state.step, seconds=time.perf_counter() - began)
        return True

    def _take_state(self, held: Held | None) -> int:
        """Collective over a newly formed group: rank 0's model, optimizer, schedule and position
        (`held`, its state from the old group; None on the other ranks) into every rank. Returns
        the step of the group's last metrics row (the mean loss of the next one spans from there)."""
        take_over(self.engine, held)
        position = [(self.state.step, self.state.samples_seen, self.cadence.last_row if self.rank == 0 else 0)]
        dist.broadcast_object_list(position, src=0)
        self.state.step, self.state.samples_seen, last_row = position[0]
        self.state.world_size = self.world_size
        return last_row

    def checkpoint_scheduled(self, step: int) -> bool:
        return checkpoint_scheduled(self.spec, step)

    def evaluate(self) -> dict[str, float]:
        """Collective: the mean loss (and metrics.factory's values) over the first `eval.batches`
        global batches of validation samples (as many whole ones as there are, if fewer), dealt
        to ranks as training batches are; the same samples at every evaluation and any world size."""
        micro = self.spec.batch.micro_batch_size
        accum = self.global_batch // (micro * self.engine.dp_size)
        batches = self.spec.eval.batches  # a stream has as many as it is asked for
        if isinstance(self.validation, Sized):
            batches = min(batches, len(self.validation) // self.global_batch)
        order = validation_order(self.validation)
        totals: dict[str, torch.Tensor] = {}
        for batch in range(batches):
            ids = micro_batch_ids(order, batch * self.global_batch, self.engine.dp_rank, self.engine.dp_size,
                                  micro, accum)
            values = self.engine.validate([self.validation.batch(i) for i in ids], self.metrics)
            for name, value in values.items():
                totals[name] = totals.get(name, 0) + value
        names = sorted(totals)  # the same on every rank: one all-reduce of them all
        summed = torch.stack([totals[name] for name in names])
        if dist.is_initialized():
            dist.all_reduce(summed)
        means = dict(zip(names, (summed / (batches * self.engine.loss_ranks)).tolist()))
        out = {f"val_{name}": value for name, value in means.items()}
        if isinstance(self.spec.model, LANGUAGE_MODELS):
            out["val_perplexity"] = math.exp(min(means["loss"], 700.0))
        return out

    def _epoch(self) -> dict[str, float]:
        """Passes over a map-style dataset so far (a stream's length is not known)."""
        return {"epoch": self.state.samples_seen / len(self.dataset)} if isinstance(self.dataset, Sized) else {}

    def _efficiency(self, tokens_per_s: float) -> dict[str, Any]:
        """Achieved model FLOP/s, MFU (where the device's peak is known), the most memory any rank
        has held, and the last step's gradient norm. Collective: a max over the ranks."""
        device = self.engine.device
        peak = torch.tensor(float(peak_memory_bytes(device)), device=device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out: dict[str, Any] = {"peak_memory_gib": peak.item() / 2**30}
        if self.flops_per_token is not None:  # None: a module of the user's own whose FLOPs cannot be counted
            achieved = tokens_per_s * self.flops_per_token
            out["model_tflops_per_s"] = achieved / 1e12
            if self.peak_flops is not None:
                out["mfu"] = achieved / (self.peak_flops * self.world_size)
        if self.engine.grad_norm is not None:
            out["grad_norm"] = float(self.engine.grad_norm)
        return out

    def _mean_loss(self, steps: int) -> dict[str, Any]:
        """The global mean loss of the last `steps` steps: one small all-reduce per report."""
        if dist.is_initialized():
            dist.all_reduce(self._loss_sum)
        loss = self._loss_sum.item() / steps
        self._loss_sum.zero_()
        return {"step": self.state.step, "loss": loss}
