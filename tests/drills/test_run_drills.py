"""Drills: a user's or a neighbour's mistake with a run, and what shardyard must do about it.

Each drill is one scenario with its expected outcome, declared on its `drill` marker: `refused`
(a message and exit code 2 before any worker starts, no traceback) or `recovered`, and the work it may lose
(`lost`). `benchmarks/drills.py` runs them and prints the table README reports. These need no
Ray: every refusal here comes before Ray is started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from shardyard.checkpoint.record import newest_name, read_record
from shardyard.cli.train import run_train
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.lease import LEASE_DIR, LeaseHeld, RunLease, current_lease
from shardyard.storage.events import Event, log_event, read_events
from shardyard.optim import lr_factor
from helpers.drills import job, write_checkpoint

HOLD = """
import sys, time
from shardyard.checkpoint.lease import RunLease
RunLease(sys.argv[1], "run", ttl_s=3.0).acquire()  # renewed every second: a watcher sees it live at once
print("held", flush=True)
time.sleep(600)
"""


def train(tmp_path: Path, raw: dict, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    """What `shardyard train CONFIG` exits with and prints on stderr (run in this process: the
    command's own function, without a new interpreter's imports)."""
    config = tmp_path / f"job_{time.monotonic_ns()}.yaml"
    config.write_text(json.dumps(raw))  # JSON is YAML
    code = run_train(str(config), [], attach_to_running=False)
    return code, capsys.readouterr().err


@pytest.mark.drill(outcome="refused", lost="nothing")
@pytest.mark.timeout(120)
def test_a_second_launch_of_a_run_in_training_is_refused_naming_the_first(tmp_path: Path, capsys) -> None:
    """Two launches with the same run.name and storage would resume from, overwrite and prune each
    other's checkpoints: the second is refused while the first holds the run."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, err = train(tmp_path, job(tmp_path), capsys)
        assert code == 2 and "is being trained by another launch (host" in err, err
        assert f"pid {holder.pid}" in err and "--take-over" in err
        assert sorted(p.name for p in run_dir.iterdir()) == [LEASE_DIR]  # the first's run untouched
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.drill(outcome="recovered", lost="nothing")
@pytest.mark.timeout(120)
def test_a_lease_left_by_a_killed_launch_is_taken_over_at_once(tmp_path: Path) -> None:
    """`ray job stop` or a kill leaves the driver's lease behind: on its host, a launch sees that
    the process is gone and takes the run over without waiting for the lease to expire."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    start = time.monotonic()
    with RunLease(str(run_dir), "run").held() as lease:
        assert current_lease(lease.storage)["id"] == lease.id and lease.generation == 2
    assert time.monotonic() - start < 5  # not the 30 s the lease would take to expire
    assert not run_dir.exists()  # released, and the run directory it made is gone with it


def _foreign_lease(run_dir: Path, beat: int, ttl_s: float) -> None:
    record = {"generation": 1, "id": "elsewhere", "beat": beat, "ttl_s": ttl_s, "released": False,
              "host": "another-node", "pid": 1, "started": 0.0}
    (run_dir / LEASE_DIR).mkdir(parents=True, exist_ok=True)
    (run_dir / LEASE_DIR / "00000001.json").write_text(json.dumps(record))


@pytest.mark.drill(outcome="refused", lost="nothing")
@pytest.mark.timeout(60)
def test_a_lease_held_on_another_host_counts_while_it_is_renewed_by_the_readers_own_clock(tmp_path: Path) -> None:
    """Another host's process cannot be asked, and its clock is not ours: its lease counts while
    its record keeps changing as this process watches it, and is gone once it stays unchanged for
    its ttl. --take-over takes it regardless."""
    run_dir = tmp_path / "run"
    _foreign_lease(run_dir, beat=0, ttl_s=2.0)
    stop = threading.Event()

    def renew() -> None:  # the other host's renewer
        beat = 0
        while not stop.wait(0.3):
            beat += 1
            _foreign_lease(run_dir, beat=beat, ttl_s=2.0)
    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        with pytest.raises(LeaseHeld, match="host another-node, pid 1"):
            RunLease(str(run_dir), "run").acquire()
    finally:
        stop.set()
        renewer.join()
    start = time.monotonic()
    with RunLease(str(run_dir), "run").held() as lease:  # no longer renewed: gone after its ttl
        assert current_lease(lease.storage)["id"] == lease.id and lease.generation == 2
    assert time.monotonic() - start >= 2.0
    _foreign_lease(run_dir, beat=0, ttl_s=300.0)
    with RunLease(str(run_dir), "run").held(take_over=True) as lease:
        assert current_lease(lease.storage)["id"] == lease.id


@pytest.mark.drill(outcome="refused", lost="nothing")
@pytest.mark.timeout(120)
def test_a_run_name_that_leaves_the_storage_path_is_refused(tmp_path: Path, capsys) -> None:
    storage = tmp_path / "runs"
    code, err = train(tmp_path, job(storage, run={"name": ".."}), capsys)
    assert code == 2 and "run.name: must be one directory name" in err, err
    assert not storage.exists() and not (tmp_path / LEASE_DIR).exists()


@pytest.mark.drill(outcome="refused", lost="nothing")
@pytest.mark.timeout(120)
def test_resuming_with_another_seed_dataset_or_model_is_refused_naming_each_key(tmp_path: Path, capsys) -> None:
    """The stored data position is a place in one seed's order over one dataset, and the stored
    weights fit one model: a resume that changes them is refused, each key named with both values,
    and nothing is written to the run."""
    raw = job(tmp_path)
    write_checkpoint(raw)
    def checkpoint_files() -> list[Path]:  # (the lease keeps a record of each launch's generation)
        return sorted(p for p in (tmp_path / "run").rglob("*") if LEASE_DIR not in p.parts)
    before = checkpoint_files()
    code, err = train(tmp_path, job(tmp_path, run={"seed": 7}, data={"num_samples": 128}, model={"n_embd": 32}),
                      capsys)
    assert code == 2, err
    for change in ("data.num_samples (64 -> 128)", "model.n_embd (16 -> 32)", "run.seed (0 -> 7)"):
        assert change in err, err
    assert checkpoint_files() == before


@pytest.mark.drill(outcome="recovered", lost="nothing")
@pytest.mark.timeout(60)
def test_resuming_with_a_new_learning_rate_and_length_applies_them_and_records_the_change(tmp_path: Path) -> None:
    """The restored LR schedule used to bring the stored optim.lr back, silently: the new rate now
    applies at the restored step of the new schedule, and the run's events say what changed."""
    from shardyard.train.preflight import check_resume

    spec = parse_spec(job(tmp_path, run={"steps": 200}))
    trained = single_process(spec, build_model(spec.model), torch.device("cpu"))
    for _ in range(3):  # the schedule at step 3 (no gradients: the weights stay)
        trained.optimizers[0].step()
        trained.schedulers[0].step()
    CheckpointManager(spec.run_uri, keep=2).save(trained, TrainState(3, 24, 1), spec)

    changed = parse_spec(job(tmp_path, optim={"lr": 2e-3}, run={"steps": 500}))
    check_resume(changed)
    recorded = [e["changes"] for e in read_events(changed.run_uri) if e["event"] == "spec_changed"]
    assert recorded == [{"optim.lr": [1e-3, 2e-3], "run.steps": [200, 500]}]
    engine = single_process(changed, build_model(changed.model), torch.device("cpu"))
    CheckpointManager(changed.run_uri, keep=2).restore(engine)
    expected = 2e-3 * lr_factor(3, changed.optim, 500)
    assert all(g["lr"] == pytest.approx(expected, rel=1e-9) for g in engine.optimizers[0].param_groups)


CUT_OFF = '{"step": 5, "killed_mid_li'  # what a writer killed in the middle of a line (or a full disk) leaves


def train_ranks(rank: int, world: int, raw: dict, attempt: float, until: int | None = None) -> None:
    """The Trainer on this rank, recording its samples (what the launcher adds for run.sample_ledger)."""
    from shardyard.train.callbacks import LedgerCallback
    from shardyard.train.trainer import Trainer

    spec = parse_spec(raw)
    ledger = LedgerCallback(spec.run_uri, f"rank{rank}", attempt)
    Trainer.build(spec, rank, world, torch.device("cpu"), callbacks=[ledger]).train(until)


@pytest.mark.drill(outcome="recovered", lost="nothing")
@pytest.mark.timeout(180)
def test_logs_cut_off_by_a_killed_writer_neither_stop_the_restart_nor_lose_a_sample(tmp_path: Path) -> None:
    """The restarted writer used to append after the cut-off line, which was then in the middle
    of the file: every later read (the metrics, the events, the sample audit) failed, so every
    later restart failed too. A writer now ends its file's cut-off tail before its first line."""
    from shardyard.data.ledger import audit
    from shardyard.localdist import run_distributed
    from shardyard.train.metrics import read_metrics

    raw = job(tmp_path, scaling={"num_workers": 2}, batch={"global_batch_size": 8, "micro_batch_size": 4},
              checkpoint={"every_n_steps": 4}, run={"steps": 8, "log_every": 1, "sample_ledger": True})
    run_distributed(train_ranks, 2, raw, 1.0, 4)  # to the checkpoint of step 4, then killed mid-write:
    run = tmp_path / "run"
    for log in run.rglob("*.jsonl"):  # every log file of the run ends in a cut-off line
        with log.open("a") as f:
            f.write(CUT_OFF)
    run_distributed(train_ranks, 2, raw, 2.0)  # the restarted run, in new processes as a restart is
    assert [row["step"] for row in read_metrics(run)] == list(range(1, 9))
    assert [log.name for log in run.rglob("*.jsonl") if CUT_OFF in log.read_text()] == []  # ended, not left in the middle
    (run / "events").mkdir(exist_ok=True)  # a launcher's event file, cut off when it was killed
    (run / "events" / "gone-host-1.jsonl").write_text('{"event": "launch", "time": 1}\n' + CUT_OFF)
    log_event(run, Event.START)
    assert [e["event"] for e in read_events(run)] == [Event.LAUNCH, Event.START]
    samples = audit(run, num_samples=64)  # 8 steps of 8: one whole epoch
    assert (samples.steps, samples.complete_epochs, samples.duplicates, samples.missing) == (8, 1, 0, 0)


@pytest.mark.drill(outcome="fails with the server's error", lost="nothing since the last checkpoint")
@pytest.mark.timeout(60)
def test_a_parameter_server_that_fails_at_every_restart_fails_the_run_instead_of_hanging_it() -> None:
    """The driver waited for a lost server to answer again, forever: a server whose every restart
    fails (its constructor raising) hung the run. A restart that answers is still waited for."""
    import ray

    from shardyard.train.parameter_server.run import _once_servers_answer

    answers = iter([ray.exceptions.ActorUnavailableError("restarting", b"\0" * 16), None])

    def restarting() -> str:
        lost = next(answers)
        if lost is not None:
            raise lost
        return "answered"

    assert _once_servers_answer(restarting, timeout_s=30) == "answered"

    def never_comes_back() -> None:
        raise ray.exceptions.ActorDiedError()

    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"has not answered for 1 s: it fails each time it restarts \(ActorDiedError"):
        _once_servers_answer(never_comes_back, timeout_s=1)
    assert time.monotonic() - started < 10


@pytest.mark.ray
@pytest.mark.drill(outcome="fails with the workers' error", lost="nothing since the last checkpoint")
@pytest.mark.timeout(180)
def test_a_failed_parameter_server_run_leaves_none_of_its_actors_behind(ray_cluster, tmp_path: Path) -> None:
    """The servers and the coordinator were killed only when the run succeeded: a failed run left
    them holding the cluster's CPUs and memory. Here every worker fails as it starts (its data file
    was removed once the run had been checked) until scaling.max_failures runs out."""
    import ray

    from shardyard.train.preflight import preflight
    from shardyard.train.parameter_server.run import ParameterServerRun

    text = tmp_path / "corpus.txt"
    text.write_text("every sample of this corpus " * 64)
    spec = parse_spec(job(tmp_path, data={"name": "corpus", "path": str(text)},
                          parallelism={"strategy": "parameter_server", "num_servers": 2},
                          batch={"global_batch_size": 8, "micro_batch_size": 4},
                          scaling={"num_workers": 2, "max_failures": 1}))
    preflight(spec)
    text.unlink()
    run = ParameterServerRun(spec)
    with pytest.raises(RuntimeError, match="2 parameter-server workers failed; scaling.max_failures is 1"):
        run.run()
    # The test still holds their handles, which alone would keep them alive. ray.kill returns
    # before the actor is gone: each is asked again until it is found dead, for a minute at most.
    deadline = time.monotonic() + 60
    for ask in [*(server.status.remote for server in run.servers), run.coordinator.progress.remote]:
        while True:
            try:
                ray.get(ask(), timeout=30)
            except ray.exceptions.ActorDiedError:
                break
            assert time.monotonic() < deadline, "a parameter-server actor outlived its failed run"
            time.sleep(0.5)


READ = """
import sys, time
from shardyard.checkpoint.reader_holds import holding
with holding(sys.argv[1], sys.argv[2]):
    print("holding", flush=True)
    time.sleep(600)
"""


@pytest.mark.drill(outcome="recovered", lost="nothing")
@pytest.mark.timeout(120)
def test_a_checkpoint_being_read_is_not_pruned_under_its_reader(tmp_path: Path) -> None:
    """Rank 0 prunes as it commits; a replacement rank loading the checkpoint it found (hot
    recovery), or a serving group, lost it mid-read. A reader holds it: pruning keeps it until
    the reader is done, and a hold whose reader was killed does not keep it for ever."""
    from shardyard.checkpoint.reader_holds import holding
    from helpers.drills import checkpoints
    spec = parse_spec(job(tmp_path))
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    manager = CheckpointManager(spec.run_uri, keep=1)
    manager.save(engine, TrainState(2, 16, 1), spec)
    with holding(spec.run_uri, "checkpoint_step_00000002"):
        manager.save(engine, TrainState(4, 32, 1), spec)
        assert checkpoints(tmp_path) == [2, 4]
        assert manager.load(engine, "checkpoint_step_00000002").step == 2  # whole while it is read
    manager.save(engine, TrainState(6, 48, 1), spec)
    assert checkpoints(tmp_path) == [6]
    reader = subprocess.Popen([sys.executable, "-c", READ, spec.run_uri, "checkpoint_step_00000006"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "holding"
        manager.save(engine, TrainState(8, 64, 1), spec)
        assert checkpoints(tmp_path) == [6, 8]  # held by another process
    finally:
        reader.kill()
        reader.wait()
    manager.save(engine, TrainState(10, 80, 1), spec)  # its reader was killed holding it
    assert checkpoints(tmp_path) == [10]


FULL_AT = "checkpoint_step_00000004"


def register_full_disk() -> None:
    """`fulldisk://PATH`: the local disk, except that it is full for the step-4 checkpoint's model
    and optimizer shards, which DCP writes in the background (an object store refusing uploads
    fails the same way)."""
    import errno

    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class FullDisk(LocalFileSystem):
        protocol = ("fulldisk",)

        def __init__(self, **kwargs) -> None:
            super().__init__(auto_mkdir=True, **kwargs)  # as an object store: no directories to make

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(str(path).removeprefix("fulldisk://"))

        def _open(self, path, mode="rb", **kwargs):
            if "w" in mode and FULL_AT in str(path) and str(path).endswith(".distcp"):  # the background write
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return super()._open(path, mode, **kwargs)

        def put_file(self, lpath, rpath, **kwargs):
            if FULL_AT in str(rpath) and os.path.isfile(lpath):  # ZeRO's files, copied up once written
                raise OSError(errno.ENOSPC, "No space left on device", str(rpath))
            return super().put_file(lpath, rpath, **kwargs)

    fsspec.register_implementation("fulldisk", FullDisk, clobber=True)


def train_on_full_disk(rank: int, world: int, raw: dict, temp_dir: str | None = None) -> str:
    """The Trainer's error on this rank, as a Ray Train worker would raise it; `temp_dir`: where
    the rank's temporary files go."""
    tempfile.tempdir = temp_dir
    register_full_disk()
    try:
        train_ranks(rank, world, raw, attempt=1.0)
    except Exception as err:  # noqa: BLE001 - the drill reports what surfaced
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.drill(outcome="fails with the storage error", lost="nothing since the last checkpoint")
@pytest.mark.timeout(180)
def test_an_asynchronous_checkpoint_that_cannot_be_written_fails_the_run_with_the_storage_error(tmp_path: Path) -> None:
    """A checkpoint written in the background (checkpoint.async_write) whose storage refuses it:
    the run fails with the storage's error at its next checkpoint or its end, the failed step is
    never committed, and the run resumes from the checkpoint before it."""
    from shardyard.localdist import run_distributed
    from shardyard.storage.store import RunStorage

    raw = job(tmp_path, scaling={"num_workers": 2}, batch={"global_batch_size": 8, "micro_batch_size": 4},
              checkpoint={"every_n_steps": 2, "async_write": True, "storage_path": f"fulldisk://{tmp_path}"},
              run={"steps": 6})
    errors = run_distributed(train_on_full_disk, 2, raw)
    assert all(e.startswith(f"CheckpointWriteError: checkpoint fulldisk://{tmp_path}/run/{FULL_AT}.attempt-")
               and "could not be written" in e and "OSError: [Errno 28] No space left on device" in e
               for e in errors), errors
    storage = RunStorage(str(tmp_path / "run"))
    assert newest_name(storage) == "checkpoint_step_00000002"
    assert read_record(storage, FULL_AT) is None


@pytest.mark.drill(outcome="fails with the storage error", lost="nothing since the last checkpoint")
@pytest.mark.slow  # two DeepSpeed launches of two ranks: about half a minute
@pytest.mark.timeout(240)
def test_a_zero_checkpoint_that_cannot_be_uploaded_leaves_no_temporary_files(tmp_path: Path) -> None:
    """DeepSpeed writes a ZeRO checkpoint into a local temporary directory, copied up to remote
    storage; a restore copies it down into another. A failed upload must fail the run with the
    storage's error and leave neither behind: a run whose step-4 upload fails, twice (the second
    attempt resumed from step 2, copied down), leaves the ranks' temporary directory empty."""
    from shardyard.localdist import run_distributed
    from shardyard.storage.store import RunStorage

    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    store = tmp_path / "store"
    raw = job(tmp_path, parallelism={"strategy": "zero1"}, scaling={"num_workers": 2},
              batch={"global_batch_size": 8, "micro_batch_size": 4},
              checkpoint={"every_n_steps": 2, "storage_path": f"fulldisk://{store}"}, run={"steps": 6})
    for _ in range(2):
        errors = run_distributed(train_on_full_disk, 2, raw, str(temp_dir))
        assert all(e.startswith(f"CheckpointWriteError: checkpoint fulldisk://{store}/run/{FULL_AT}.attempt-")
                   and "could not be written (rank " in e and "OSError: [Errno 28] No space left on device" in e
                   for e in errors), errors
        assert sorted(p.name for p in temp_dir.iterdir()) == []
    resumed = [json.loads(line)["resumed_at"] for line in (store / "run" / "metrics.jsonl").read_text().splitlines()
               if "resumed_at" in line]
    assert resumed == [0, 2]
    storage = RunStorage(str(store / "run"))
    assert newest_name(storage) == "checkpoint_step_00000002"
    assert read_record(storage, FULL_AT) is None


@pytest.mark.drill(outcome="recovered", lost="nothing")
@pytest.mark.timeout(60)
def test_a_committed_checkpoint_is_never_deleted_to_be_written_again(tmp_path: Path) -> None:
    """A save of a step whose checkpoint an earlier attempt committed used to delete it and write
    it again: a crash (here, a full disk) in between lost the step. The committed one is kept."""
    from shardyard.storage.store import RunStorage

    register_full_disk()
    spec = parse_spec(job(tmp_path))
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    CheckpointManager(spec.run_uri, keep=2).save(engine, TrainState(4, 32, 1), spec)
    again = parse_spec(job(tmp_path, checkpoint={"storage_path": f"fulldisk://{tmp_path}"}))
    CheckpointManager(again.run_uri, keep=2).save(engine, TrainState(4, 32, 1), again)
    assert newest_name(RunStorage(spec.run_uri)) == FULL_AT
    assert CheckpointManager(spec.run_uri, keep=2).restore(engine).step == 4


def failure(step: int | None, error: str, from_code: bool = True) -> list[dict]:
    return [{"event": "start", "restored_step": step}, {"event": "failure", "errors": {"0": error, "1": error},
                                                        "from_code": from_code}]


@pytest.mark.timeout(30)
def test_only_the_same_error_from_the_same_step_twice_counts_as_deterministic() -> None:
    from shardyard.train.outcomes import repeated_failure

    launch = [{"event": "launch", "id": "this"}]
    bad = "ValueError: bad header"
    assert repeated_failure(launch + failure(4, bad) + failure(4, bad), "this") is not None
    assert repeated_failure(launch + failure(4, bad), "this") is None  # once: retried
    assert repeated_failure(launch + failure(4, bad) + failure(8, bad), "this") is None  # progress between
    assert repeated_failure(launch + failure(4, bad) + failure(4, "OSError: disk"), "this") is None
    lost = "ActorDiedError: the actor died"  # Ray's report of a lost process: always retried
    assert repeated_failure(launch + failure(4, lost, False) + failure(4, lost, False), "this") is None
    # A new launch (the user fixed the cause) starts counting afresh.
    assert repeated_failure(failure(4, bad) + failure(4, bad) + [{"event": "launch", "id": "next"}], "next") is None


@pytest.mark.ray
@pytest.mark.drill(outcome="fails after 2 tries, not max_failures + 1", lost="nothing")
@pytest.mark.timeout(300)
def test_a_deterministic_error_is_not_retried_until_max_failures_runs_out(ray_cluster, tmp_path: Path) -> None:
    """A Hugging Face model directory whose weights file is corrupt: every worker group fails
    loading it. With scaling.max_failures 5 the run used to start 6 groups that all failed the same
    way; it stops after the second, saying why (exit 1, no traceback)."""
    from shardyard.storage.events import read_events
    from helpers.models import save_llama
    save_llama(tmp_path / "llama")
    (tmp_path / "llama" / "model.safetensors").write_bytes(b"\xff" * 64)  # a download cut short
    raw = job(tmp_path, scaling={"num_workers": 1, "max_failures": 5})
    raw["model"] = {"name": "hf", "path": str(tmp_path / "llama"), "block_size": 8}
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps(raw))
    code = run_train(str(config), [], attach_to_running=True)
    import ray

    assert ray.is_initialized()  # the caller's connection (this session's) outlives the command
    events = [e["event"] for e in read_events(tmp_path / "run")]
    assert code == 1 and events.count("failure") == 2 and "gave_up" in events, events
