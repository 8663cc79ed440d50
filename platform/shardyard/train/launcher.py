"""Driver side: turn a validated JobSpec into a Ray Train V2 TorchTrainer run and report on it.

The only Ray-aware part of training (the one Ray Train adapter): each Ray Train worker builds a
`Trainer` from the spec and its place in the worker group and calls `train()`. What depends on the
recovery mode is decided here, once, at build time: under hot recovery every replica runs in a
process group of its own, so one replica writes checkpoints.

Ray Train is told nothing about checkpoints: shardyard's commit records alone say which a run has
(checkpoint/record.py), and Ray Train's own files live apart, under `<run>/ray_train/`, holding
no reference that pruning could break. The driver holds the run's lease for the whole launch;
its workers check it (`LeaseFence`) before each commit and at step boundaries. SIGTERM to the
driver (a spot instance's notice, a Kubernetes eviction, `ray job stop`) asks the workers to
checkpoint at the next step boundary and stop (`<run>/PREEMPT`); the driver then exits 143.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
import torch.distributed as dist
from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig, TrainingFailedError, UserCallback
from ray.train.torch import TorchConfig, TorchTrainer

from shardyard.data.corpus import corpus_files
from shardyard.data.shards import TOKENIZER_DIR, open_split, read_index, tokenizer_files, validation_source
from shardyard import exit_codes
from shardyard.cluster import connect_ray
from shardyard.train.early_sigterm import sigterm_handler_kept, stop_if_terminated, terminated
from shardyard.runtime import select_device
from shardyard.spec import ZERO_STAGES, JobSpec, SpecError
from shardyard.train.callbacks import (
    CrashAtCheckpoint,
    HoldAtSteps,
    LedgerCallback,
    RunEvents,
    group_attempt,
    hold_steps,
    injected_crash_step,
)
from shardyard.checkpoint.layout import SPEC_FILE, stored_spec
from shardyard.checkpoint.lease import LeaseFence, LeaseLost, RunLease
from shardyard.checkpoint.record import newest_good, newest_step
from shardyard.storage.store import RunStorage
from shardyard.storage.events import Event, launch_end, log_event, read_events
from shardyard.train.metrics import RunResult, finish_run
from shardyard.train.restart_lines import restart_lines, restarts_allowed
from shardyard.train.startup import StartupPhases, driver_marks, report
from shardyard.train.step_guard import PREEMPT_FILE, Diverged
from shardyard.train.trainer import Callback, Trainer
from shardyard.train.worker_resources import place_workers


def node_drained() -> bool:
    """Collective over the worker group: whether Ray is draining a worker's node (a spot instance's
    reclaim notice, `ray drain-node`); the run then checkpoints at once (Ray Train restarts the
    group from it when the node goes). Not under hot recovery: replicas are no one group."""
    return ray.train.get_preemption_info() is not None


def train_worker(config: dict[str, Any]) -> None:
    """Entry point of each Ray Train worker. `config["spec"]` is the job spec as the driver
    validated it (not validated again here: that would import a custom model's factory and read a
    Hugging Face config in every worker); `progress_bar` says whether the driver has a terminal to draw a bar on;
    `crash_at_checkpoint` and `hold_at` are fault-injection settings read on the driver."""
    entered_at = time.time()
    spec: JobSpec = config["spec"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    launch_id = config["launch_id"]
    fence = LeaseFence(spec.run_uri, config["lease_generation"], config["lease_id"], config["lease_base_step"])
    try:
        fence()
    except LeaseLost as err:  # a group restarted after its launch lost the run: it starts nothing
        if rank == 0:
            log_event(spec.run_uri, Event.LEASE_LOST, launch=launch_id, reason=str(err))
        return
    reason = repeated_failure(read_events(spec.run_uri), launch_id)
    if reason is not None:  # every rank reads the same events: all of them end here
        if rank == 0:
            log_event(spec.run_uri, Event.GAVE_UP, launch=config["launch_id"], reason=reason)
        return
    hot = spec.scaling.recovery == "hot"
    if not hot:  # hot-recovery replicas are no one group: they keep the launch's fence
        # This worker group's own attempt: a group Ray Train gave up on that still runs (a node cut
        # off from Ray but not from storage) is fenced off, and its late commits are stale.
        group_fence: list[LeaseFence] = [fence.for_new_group() if rank == 0 else fence]
        if dist.is_initialized():
            dist.broadcast_object_list(group_fence, src=0)
        fence = group_fence[0]
    callbacks: list[Callback] = [RunEvents(), StartupPhases(launch_id, config["startup"], entered_at)]
    if spec.run.sample_ledger:
        # Hot-recovery replicas are not one group, and replacements join a running step
        # sequence: one attempt id for all of them.
        callbacks.append(LedgerCallback(spec.run_uri, rank, 0.0 if hot else group_attempt()))
    if config["crash_at_checkpoint"] is not None:
        callbacks.append(CrashAtCheckpoint(config["crash_at_checkpoint"]))
    if config["hold_at"]:
        callbacks.append(HoldAtSteps(config["hold_at"]))
    if spec.checkpoint.publish_to is not None:
        from shardyard.train.publish import WeightsPublisher  # Serve, for runs that publish only

        callbacks.append(WeightsPublisher(spec.checkpoint.publish_to,
                                          spec.checkpoint.publish_every_n_steps or spec.checkpoint.every_n_steps))
    device = select_device(context.get_local_rank(), config["use_gpu"])
    trainer = Trainer.build(spec, rank, world_size, device, callbacks=callbacks,
                            checkpoint_writer=not hot or rank == 0, fence=fence,
                            node_drained=None if hot else node_drained,
                            replica_id=f"{spec.run.name}_{rank}", progress_bar=config["progress_bar"])
    try:
        trainer.train()
    except (LeaseLost, Diverged) as err:  # every rank raised it at the same step: end the group here
        if rank == 0:
            kind = Event.LEASE_LOST if isinstance(err, LeaseLost) else Event.DIVERGED
            log_event(spec.run_uri, kind, launch=launch_id, reason=str(err), step=trainer.state.step)
        return
    if trainer.preempted and rank == 0:
        log_event(spec.run_uri, Event.PREEMPTED, launch=launch_id, step=trainer.state.step)


class FailureLog(UserCallback):
    """Runs on the Ray Train controller: records each worker failure before the group restarts."""

    def __init__(self, run_uri: str) -> None:
        self.run_uri = run_uri

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        errors = {r: f"{type(e).__name__}: {e}"[:300] for r, e in sorted(worker_exceptions.items())}
        # Raised by the training code (a bug, bad data, a model that cannot fit), not Ray's own
        # report of a process or node lost: only such errors can repeat deterministically.
        lost = [r for r, e in sorted(worker_exceptions.items()) if type(e).__module__.startswith("ray.")]
        log_event(self.run_uri, Event.FAILURE, ranks=sorted(errors), errors=errors, from_code=not lost, lost=lost)


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


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C: the launch stops without waiting for a checkpoint (a KeyboardInterrupt,
    so that it leaves through every `except Exception`). Its message says what is lost."""


# The signals that ask a running launch to checkpoint at the next step boundary and stop, by the
# name the user knows them by.
NOTICES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}


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


def preflight(spec: JobSpec) -> None:
    """Checks that need this machine, the cluster or the run's storage, done before any worker
    starts."""
    check_resume(spec)
    if spec.data.name == "corpus":
        try:
            corpus_files(spec.data.path)
        except FileNotFoundError as err:
            raise SpecError(str(err)) from None
    if spec.data.name == "corpus" and getattr(spec.model, "vocab_size", 256) < 256:
        raise SpecError("data.name 'corpus' is byte-level: model.vocab_size must be at least 256")
    if spec.data.name == "shards":
        check_shards(spec)


def check_shards(spec: JobSpec) -> None:
    """The prepared directory's index is readable, matches its shards (local ones: their sizes)
    and its tokenizer's ids fit the model's embedding."""
    path = spec.data.path
    try:
        index = read_index(path)
        open_split(path, "train", spec.model.block_size, spec.data.cache_dir, spec.data.cache_bytes)
    except ValueError as err:  # ShardIndexError, or too few tokens for one sample
        raise SpecError(f"data.path {path!r}: {err}") from None
    if spec.eval.every_n_steps is not None:
        try:
            where, split = validation_source(path, spec.data.validation_path)
            validation = open_split(where, split, spec.model.block_size, spec.data.cache_dir, spec.data.cache_bytes)
        except ValueError as err:
            raise SpecError(f"eval.every_n_steps: {err}") from None
        if len(validation) < spec.batch.global_batch_size:
            raise SpecError(f"eval.every_n_steps: {where}'s {split} split holds {len(validation)} samples of "
                            f"{spec.model.block_size + 1} tokens, fewer than one global batch "
                            f"({spec.batch.global_batch_size}): prepare with a larger output.validation_fraction")
    vocab = getattr(spec.model, "vocab_size", None)
    if vocab is not None and index["vocab_size"] > vocab:
        raise SpecError(f"data.path {path!r} was tokenized with {index['vocab_size']} ids, more than "
                        f"model.vocab_size ({vocab}): set model.vocab_size to at least {index['vocab_size']}")
    adopt_tokenizer(spec)


ADOPTED = "ADOPTED.json"  # in the run's tokenizer/: each adopted file's digest


def adopt_tokenizer(spec: JobSpec) -> None:
    """The data's tokenizer goes into the run directory (`tokenizer/`) at the run's first launch:
    serving and exports find it there, wherever the data goes later. A later launch on data of
    another tokenizer is refused: the model's ids would mean other text.

    The run has adopted a tokenizer once `tokenizer/ADOPTED.json` lists every file's digest; it is
    written last (locally the folder appears whole: it is written aside and renamed into place),
    so a launch cut off part way is completed by the next, never taken for adopted."""
    try:
        files = tokenizer_files(spec.data.path)
    except ValueError as err:  # ShardIndexError: an index that names another folder
        raise SpecError(f"data.path {spec.data.path!r}: {err}") from None
    if not files:
        return
    storage = RunStorage(spec.run_uri)
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())}
    refusal = SpecError(f"run '{spec.run.name}' was trained with the tokenizer in {storage.url(TOKENIZER_DIR)}; "
                        f"data.path {spec.data.path!r} was tokenized with another: use another run.name")
    manifest = json.dumps(digests, indent=1).encode()
    if storage.exists(TOKENIZER_DIR, ADOPTED):
        if json.loads(storage.read_bytes(TOKENIZER_DIR, ADOPTED)) != digests:
            raise refusal
        return
    if storage.exists(TOKENIZER_DIR, "tokenizer.json"):  # adopted before the list was kept, or cut short
        if storage.read_bytes(TOKENIZER_DIR, "tokenizer.json") != files.get("tokenizer.json"):
            raise refusal
    elif not storage.remote and not storage.exists(TOKENIZER_DIR):
        aside = f"{TOKENIZER_DIR}.adopting-{secrets.token_hex(4)}"
        for name, data in {**files, ADOPTED: manifest}.items():
            storage.write_bytes(data, aside, name)
        if storage.place(aside, TOKENIZER_DIR):
            return
        storage.delete(aside)  # another launch placed one meanwhile: judged below like any other
        return adopt_tokenizer(spec)
    for name, data in files.items():
        storage.write_bytes(data, TOKENIZER_DIR, name)
    if not storage.create_exclusive(manifest, TOKENIZER_DIR, ADOPTED):
        adopt_tokenizer(spec)  # another launch listed its files first: theirs must be these


# What a resumed run may not change: the stored weights, or the stored data position (a place in
# one seed's order over one dataset), would then mean something else.
FIXED_ON_RESUME = ("model.", "data.name", "data.path", "data.max_bytes", "data.num_samples", "run.seed")


def spec_changes(stored: JobSpec, spec: JobSpec) -> dict[str, list[Any]]:
    """Every setting whose value differs, by dotted key (`optim.lr`), as [stored, new]."""
    def flat(value: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): value}

    old, new = flat(stored.model_dump(mode="json")), flat(spec.model_dump(mode="json"))
    return {key: [old.get(key), new.get(key)] for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)}


def check_resume(spec: JobSpec) -> None:
    """A run that resumes is compared with the spec of its newest committed checkpoint before any
    worker starts: a change that cannot apply (model, data source, seed) is refused naming each
    key; the rest (steps, lr and schedule, world size, strategy, cadence...) apply and are recorded
    in the run's events. Optimizer state must be loadable unless the spec leaves it behind."""
    storage = RunStorage(spec.run_uri)
    found = newest_good(storage)
    if found is None:
        return
    name, record = found
    where = storage.url(name)
    stored = stored_spec(storage.read_bytes(name, SPEC_FILE))
    changes = spec_changes(stored, spec)
    fixed = [key for key in changes if key.startswith(FIXED_ON_RESUME)]
    if fixed:
        listed = ", ".join(f"{key} ({changes[key][0]!r} -> {changes[key][1]!r})" for key in fixed)
        raise SpecError(f"run '{spec.run.name}' resumes from {where}, which was trained with other settings that "
                        f"cannot change on resume: {listed}. Set them back, or use another run.name (or "
                        f"storage path) for a new run")
    if changes:
        log_event(spec.run_uri, Event.SPEC_CHANGED, checkpoint=name, changes=changes)
    if spec.checkpoint.load_optimizer:
        check_optimizer_resumes(spec, stored, record["world_size"], where)
    # The user relaunching sees where the run picks up and what their command changed, before Ray's output.
    changed = "".join(f"; {key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
    workers = f"{record['world_size']} worker{'s' if record['world_size'] != 1 else ''}"
    print(f"shardyard: run '{spec.run.name}' resumes from {where} (step {record['step']}, "
          f"{stored.parallelism.strategy} on {workers}){changed}", file=sys.stderr, flush=True)


def check_optimizer_resumes(spec: JobSpec, stored: JobSpec, written_at: int, where: str) -> None:
    """The stored optimizer state loads into the optimizer and strategy `spec` names."""
    same_zero = stored.parallelism.strategy == spec.parallelism.strategy and spec.scaling.num_workers == written_at
    if stored.parallelism.strategy in ZERO_STAGES and stored.optim.name == "sgd" and stored.optim.momentum \
            and not same_zero:
        raise SpecError(f"run '{spec.run.name}' resumes from {where}, a ZeRO checkpoint with SGD momentum: "
                        f"DeepSpeed reshards or converts Adam's state only, so the momentum cannot follow to "
                        f"another strategy or world size. Set checkpoint.load_optimizer=false to resume with "
                        f"the weights, LR schedule and data position only")
    if stored.optim.name != spec.optim.name:
        raise SpecError(f"run '{spec.run.name}' resumes from {where}, trained with optim.name "
                        f"'{stored.optim.name}': its optimizer state cannot be loaded into '{spec.optim.name}'. "
                        f"Set checkpoint.load_optimizer=false to resume with the weights, LR schedule and "
                        f"data position only")


def scaling_config(spec: JobSpec, cluster: dict[str, float], can_grow: bool) -> ScalingConfig:
    """Ray Train's worker group for `spec` on a cluster with `cluster` resources (see
    train/worker_resources.py for where the workers go and why)."""
    placement = place_workers(spec, cluster, can_grow)
    if placement.reason:  # the user reads it before Ray's output, not in a log file
        print(f"shardyard: {placement.reason}", file=sys.stderr, flush=True)
    s = spec.scaling
    num_workers = s.num_workers if s.num_workers is not None else (s.min_workers, s.max_workers)
    return ScalingConfig(num_workers=num_workers, use_gpu=placement.use_gpu, resources_per_worker=placement.resources,
                         elastic_resize_monitor_interval_s=s.resize_check_interval_s)


def tune_ray_train(spec: JobSpec) -> None:
    """Failure detection and restart timing that Ray Train reads from the driver's environment
    (and passes on to its controller). After a node is lost, a restart may first be tried at the
    old size on stale resource data; the start timeout bounds how long that doomed try waits."""
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(spec.scaling.health_check_interval_s)
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(spec.scaling.worker_start_timeout_s)
    # Ray Train sends each worker's print() to its logger, which writes it to stderr, and prints it
    # too where Ray has wrapped the worker's stdout, as it has: every progress line came out twice.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")


# How long the Lighthouse waits for a replica that is alive (heartbeating) but has not asked to
# join a quorum yet. torchft's Python default is short: replicas behind a live one (a rank that
# failed to heal from a peer killed mid-copy, and a replacement) then formed a quorum without it,
# ran again a step it had already applied, and went on with it on two different states (a CI
# run's ledger: step 26 committed by two quorums). A live replica asks at the latest once a
# collective on a dead peer fails (the process group's timeout, fault_tolerant_ddp.TIMEOUT, 30 s);
# the others' quorum requests time out after torchft's 60 s.
STRAGGLER_JOIN_TIMEOUT_MS = 45_000


def torch_config(spec: JobSpec) -> TorchConfig | None:
    """Ray Train's default (nccl on GPUs, gloo otherwise), except under hot recovery: there every
    worker is a replica in a process group of its own, coordinated by torchft's Lighthouse, which
    Ray Train runs (one quorum member is enough to go on once the others are dead: a replica that
    stops heartbeating is left out at once, a live one is waited for)."""
    if spec.scaling.recovery != "hot":
        return None
    from ray.train.v2.torch.torchft_config import TorchftConfig

    return TorchftConfig(lighthouse_kwargs={"min_replicas": 1, "join_timeout_ms": STRAGGLER_JOIN_TIMEOUT_MS})


def launch(spec: JobSpec, attach_to_running: bool = False, take_over: bool = False,
           began_at: float | None = None) -> RunResult:
    """Train `spec` to its end (resuming its newest good checkpoint), holding the run's lease
    throughout: a second launch of the same run is refused (`take_over`: see checkpoint/lease.py)."""
    with RunLease(spec.run_uri, spec.run.name, ttl_s=spec.checkpoint.lease_ttl_s).held(take_over) as lease:
        return _launch(spec, attach_to_running, lease, began_at)


@dataclass
class Notice:
    """What a launch heard: the first notice's signal by name (NOTICES), None while none came."""
    by: str | None = None


@contextmanager
def preemption_notice(spec: JobSpec) -> Iterator[Notice]:
    """While the block runs, SIGTERM or a Ctrl-C asks the workers to checkpoint at the next step
    boundary and stop (`<run>/PREEMPT`); if the run has not ended `checkpoint.preempt_timeout_s`
    later, the driver exits anyway. A second Ctrl-C stops the launch at once (StoppedAtOnce).
    Installed after Ray's own driver handler, which would abort at once; Ray Train's own Ctrl-C
    handler (which aborts the workers wherever they are) is never installed: `fit_in_background`.
    Yields the Notice, filled in once one is heard."""
    storage = RunStorage(spec.run_uri)
    storage.delete(PREEMPT_FILE)  # a notice a stopped launch left behind is not for this one
    heard = Notice()
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield heard
        return
    # The handler only queues the notice (SimpleQueue.put is reentrant): printing or starting a
    # thread inside it could deadlock or raise when a second signal lands while the first is handled.
    notices: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    ended = threading.Event()
    interrupts = [0]

    def on_signal(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT:
            interrupts[0] += 1
            if interrupts[0] > 1:
                raise StoppedAtOnce()
        notices.put(NOTICES[signum])

    def act_on_notice() -> None:
        by = notices.get()
        if by is None:
            return
        heard.by = by
        timeout = spec.checkpoint.preempt_timeout_s
        deadline = time.monotonic() + timeout
        again = "; Ctrl-C again stops at once, losing the steps since the last checkpoint" if by == "Ctrl-C" else ""
        print(f"shardyard: {by}: checkpointing run '{spec.run.name}' at the next step boundary, then "
              f"stopping (at most {timeout:g} s{again})", file=sys.stderr, flush=True)
        while time.monotonic() < deadline:  # storage that fails now may answer in a moment
            try:
                storage.write_bytes(str(time.time()).encode(), PREEMPT_FILE)
                break
            except OSError as err:
                print(f"shardyard: cannot write the preemption notice {storage.url(PREEMPT_FILE)} ({err}); "
                      f"retrying", file=sys.stderr, flush=True)
                if ended.wait(1.0):
                    return
        if not ended.wait(max(0.0, deadline - time.monotonic())):
            print(f"shardyard: no checkpoint committed within checkpoint.preempt_timeout_s ({timeout:g} s); "
                  f"stopping: a new launch resumes from the last committed one", file=sys.stderr, flush=True)
            os._exit(exit_codes.PREEMPT_TIMED_OUT)

    watcher = threading.Thread(target=act_on_notice, name="shardyard-preemption-notice", daemon=True)
    watcher.start()
    previous = {signum: signal.signal(signum, on_signal) for signum in NOTICES}
    if terminated():  # heard by the handler before this one, after the launch's last look at it
        notices.put("SIGTERM")
    try:
        yield heard
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        ended.set()
        notices.put(None)
        watcher.join()
        storage.delete(PREEMPT_FILE)


def fit_in_background(trainer: TorchTrainer) -> None:
    """`trainer.fit()` on a thread of its own, the main thread waiting for it: Ray Train installs
    its Ctrl-C handler (which aborts the workers mid-step, losing what they had not committed) only
    when fit runs on the main thread, and this launcher's own (preemption_notice) checkpoints first.
    The main thread waits in short joins, between which Python runs its signal handlers."""
    raised: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as err:  # noqa: BLE001 - handed to the main thread, raised there
            raised.append(err)

    thread = threading.Thread(target=fit, name="shardyard-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if raised:
        raise raised[0]


def failure_summary(err: TrainingFailedError) -> str:
    """Ray Train's final error in a line: each failed rank's error, first line only."""
    failures = getattr(err, "worker_failures", None) or {}
    if not failures:
        return str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    return "; ".join(f"rank {rank}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
                     for rank, e in sorted(failures.items()))


def stopped_at_once(spec: JobSpec) -> str:
    """After a second Ctrl-C: Ray is shut down (a local instance and this driver's workers with
    it), then what a new launch resumes from, and so what is lost."""
    ray.shutdown()
    step = newest_step(RunStorage(spec.run_uri))
    resumes = f"from step {step}, its last committed checkpoint" if step else "from the start"
    return (f"second Ctrl-C: run '{spec.run.name}' stopped at once; a new launch resumes {resumes}, and the steps "
            f"trained after it are lost")


def _launch_parameter_servers(spec: JobSpec, lease: RunLease) -> RunResult:
    """The parameter-server run in this driver, with the guarantees of the others: SIGTERM
    checkpoints the step being computed and stops; a non-finite loss or weights stop the run
    before anything from them is committed; a lost lease stops it."""
    from shardyard.train.parameter_server import ParameterServerRun

    ps = ParameterServerRun(spec, fence=lease.fence())
    stop_if_terminated()
    with preemption_notice(spec) as notice:
        try:
            result = ps.run()
        except StoppedAtOnce:
            raise StoppedAtOnce(stopped_at_once(spec)) from None
        except (Diverged, LeaseLost) as err:
            log_event(spec.run_uri, Event.DIVERGED if isinstance(err, Diverged) else Event.LEASE_LOST, reason=str(err),
                      step=ps.state.step)
            raise RunGaveUp(f"run '{spec.run.name}' stopped: {err}") from None
    if ps.preempted:
        raise Preempted(f"run '{spec.run.name}' stopped on {notice.by or 'a preemption notice'} after committing "
                        f"step {ps.state.step}; launch it again to continue from there", notice.by)
    return result


def _launch(spec: JobSpec, attach_to_running: bool, lease: RunLease, began_at: float | None) -> RunResult:
    stop_if_terminated()
    preflight(spec)
    stop_if_terminated()
    fault_injection = {"crash_at_checkpoint": injected_crash_step(), "hold_at": hold_steps()}
    largest = spec.scaling.world_sizes[-1] * spec.scaling.resources_per_worker.get("CPU", 1.0)
    ray_started_at = time.time()
    with sigterm_handler_kept():
        can_grow = connect_ray(largest, attach_to_running)
    ray_start_s = time.time() - ray_started_at
    if spec.parallelism.strategy == "parameter_server":  # its own actors, not a Ray Train group
        return _launch_parameter_servers(spec, lease)
    tune_ray_train(spec)
    launch_id = uuid.uuid4().hex
    scaling = scaling_config(spec, ray.cluster_resources(), can_grow)
    log_event(spec.run_uri, Event.LAUNCH, id=launch_id, lease_generation=lease.generation)
    trainer = TorchTrainer(
        train_worker,
        torch_config=torch_config(spec),
        train_loop_config={"spec": spec, "progress_bar": sys.stdout.isatty(),
                           "launch_id": launch_id, "lease_generation": lease.generation, "lease_id": lease.id,
                           "lease_base_step": lease.base_step,
                           "use_gpu": scaling.use_gpu, "startup": driver_marks(ray_started_at, ray_start_s, began_at),
                           **fault_injection},
        scaling_config=scaling,
        run_config=RunConfig(
            # Ray Train's own files, apart from the checkpoints it is never told of: the workers
            # resume from the newest good checkpoint by shardyard's commit records.
            name=spec.run.name,
            storage_path=RunStorage(spec.run_uri).url("ray_train"),
            failure_config=FailureConfig(max_failures=spec.scaling.max_failures),
            callbacks=[FailureLog(spec.run_uri)],
            # Ray Train's per-report INFO lines would drown shardyard's own progress output.
            logging_config=LoggingConfig(log_level="WARNING"),
        ),
    )
    start = time.perf_counter()
    stop_if_terminated()
    with preemption_notice(spec) as notice, restart_lines(spec.run_uri, launch_id, spec.scaling.max_failures):
        try:
            fit_in_background(trainer)
        except StoppedAtOnce:
            raise StoppedAtOnce(stopped_at_once(spec)) from None
        except TrainingFailedError as err:  # Ray Train's restarts ran out: its tracebacks are in the run's Ray log
            raise RunGaveUp(f"run '{spec.run.name}' stopped: {failure_summary(err)}; scaling.max_failures "
                            f"({restarts_allowed(spec.scaling.max_failures)}) restarts were used. Launching it again "
                            f"resumes from step {newest_step(RunStorage(spec.run_uri))}") from None
    ended = launch_end(read_events(spec.run_uri), launch_id)
    startup = report(ended.first_step)
    if ended.stopped is not None:
        raise RunGaveUp(f"run '{spec.run.name}' stopped: {ended.stopped['reason']}")
    if ended.preempted_at is not None:
        raise Preempted(f"run '{spec.run.name}' stopped on {notice.by or 'a preemption notice'} after committing "
                        f"step {ended.preempted_at}; launch it again to continue from there", notice.by)
    return finish_run(spec, f"shardyard run '{spec.run.name}' ({spec.parallelism.strategy})", start, startup)
