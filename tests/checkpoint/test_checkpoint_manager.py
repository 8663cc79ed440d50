"""The CheckpointManager's protocol in one process (no process group), the run's logs with several
writers, and the checks a resumed run gets before any worker starts."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
from pathlib import Path

import pytest
import torch

from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import SpecError, parse_spec
from shardyard.checkpoint.record import COMMIT_FILE, BadCheckpoint, checkpoint_name
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.loaders import find_latest, load_model
from shardyard.train.preflight import check_resume
from shardyard.storage.events import Event, log_event, read_events
from shardyard.train.metrics import METRICS_FILE, MetricsLog, read_metrics


def spec_for(storage: Path, **sections: dict):
    raw = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
           "data": {"name": "synthetic", "num_samples": 64}, "scaling": {"num_workers": 1},
           "batch": {"global_batch_size": 8, "micro_batch_size": 8},
           "checkpoint": {"storage_path": str(storage), "keep": 2}, "run": {"name": "run"}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return parse_spec(raw)


def engine_for(spec):
    torch.manual_seed(spec.run.seed)
    return single_process(spec, build_model(spec.model), torch.device("cpu"))


@pytest.mark.timeout(60)
def test_only_committed_checkpoints_count_and_pruning_keeps_the_newest(tmp_path: Path) -> None:
    spec = spec_for(tmp_path)
    engine = engine_for(spec)
    manager = CheckpointManager(spec.run_uri, keep=2)
    for step in (1, 2, 3):
        manager.save(engine, TrainState(step, 8 * step, 1), spec)
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("checkpoint_step_*")) == ["checkpoint_step_00000002",
                                                                    "checkpoint_step_00000003"]
    assert json.loads((run / "checkpoint_step_00000003" / COMMIT_FILE).read_text())["step"] == 3
    # A write cut short: everything but the commit record.
    partial = run / "checkpoint_step_00000004"
    partial.mkdir()
    (partial / "spec.json").write_text(spec.model_dump_json())
    assert find_latest(run).name == "checkpoint_step_00000003"
    with pytest.raises(BadCheckpoint, match="not a committed checkpoint"):
        load_model(partial)
    fresh = engine_for(spec)
    restored = CheckpointManager(spec.run_uri, keep=2).restore(fresh)
    assert restored == TrainState(3, 24, 1) and not partial.exists()  # restore clears what never committed
    for name, value in engine.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], value), name


@pytest.mark.timeout(60)
def test_a_resumed_run_with_another_model_or_optimizer_is_refused_before_it_starts(tmp_path: Path, capsys) -> None:
    spec = spec_for(tmp_path)
    CheckpointManager(spec.run_uri, keep=2).save(engine_for(spec), TrainState(1, 8, 1), spec)
    check_resume(spec)  # the same spec resumes, and says where from
    checkpoint = tmp_path / "run" / checkpoint_name(1)
    assert capsys.readouterr().err == f"shardyard: run 'run' resumes from {checkpoint} (step 1, ddp on 1 worker)\n"
    check_resume(spec_for(tmp_path, parallelism={"strategy": "fsdp"}, run={"steps": 20}))
    assert capsys.readouterr().err.endswith("(step 1, ddp on 1 worker); parallelism.strategy 'ddp' -> 'fsdp'; "
                                            "run.steps 200 -> 20\n")
    with pytest.raises(SpecError, match="model.n_embd"):
        check_resume(spec_for(tmp_path, model={"n_embd": 32}))
    sgd = spec_for(tmp_path, optim={"name": "sgd"})
    with pytest.raises(SpecError, match="checkpoint.load_optimizer=false"):
        check_resume(sgd)
    check_resume(spec_for(tmp_path, optim={"name": "sgd"}, checkpoint={"load_optimizer": False}))


@pytest.mark.timeout(60)
def test_a_committed_checkpoint_is_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """Another user (a serving account, a colleague copying the run) reads what the run wrote:
    the commit record and the spec were once 0600 whatever the umask, DCP's shards 0644."""
    spec = spec_for(tmp_path)
    previous = os.umask(0o022)
    try:
        CheckpointManager(spec.run_uri, keep=2).save(engine_for(spec), TrainState(1, 8, 1), spec)
    finally:
        os.umask(previous)
    checkpoint = tmp_path / "run" / checkpoint_name(1)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in checkpoint.iterdir() if path.is_file()}
    assert COMMIT_FILE in modes and set(modes.values()) == {0o644}, modes


def _write_events(run_dir: str, writer: int) -> None:
    for i in range(200):
        log_event(run_dir, Event.HELD, writer=writer, i=i)


@pytest.mark.timeout(120)
def test_events_from_concurrent_writers_are_all_kept(tmp_path: Path) -> None:
    # Forked: the writers only append to files, and a spawned one would spend seconds importing torch.
    writers = [multiprocessing.get_context("fork").Process(target=_write_events, args=(str(tmp_path), w))
               for w in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    events = read_events(tmp_path)
    assert len(events) == 800 and {(e["writer"], e["i"]) for e in events} == {(w, i) for w in range(4) for i in range(200)}


@pytest.mark.timeout(60)
def test_metrics_survive_a_cut_off_line_and_drop_rows_a_restart_recomputes(tmp_path: Path) -> None:
    row = {"loss": 1.0, "tokens_per_s": 1.0, "samples_per_s": 1.0, "world_size": 1, "lr": 0.1}
    spec = parse_spec({"checkpoint": {"storage_path": str(tmp_path)}, "run": {"name": "run"}})
    run_dir = tmp_path / "run"
    log = MetricsLog(spec, resume_step=0)
    for step in (10, 20, 30):
        log.append({**row, "step": step})
    log.close()
    restarted = MetricsLog(spec, resume_step=20)  # resumed from step 20's checkpoint
    restarted.append({**row, "step": 30, "loss": 0.5})
    restarted.close()
    with (run_dir / METRICS_FILE).open("a") as f:
        f.write('{"step": 40, "lo')  # a writer killed mid-line
    assert [(r["step"], r["loss"]) for r in read_metrics(run_dir)] == [(10, 1.0), (20, 1.0), (30, 0.5)]
    with (run_dir / METRICS_FILE).open("a") as f:
        f.write('\n{"step": 50}\n')  # the cut-off line is now in the middle: that is damage
    with pytest.raises(ValueError, match="line 7 is not JSON"):
        read_metrics(run_dir)


@pytest.mark.timeout(60)
def test_zero_files_are_copied_down_without_the_holds_other_readers_release_meanwhile(tmp_path: Path) -> None:
    """Ranks resuming from remote storage each hold the checkpoint while they copy its ZeRO files
    down. A hold another rank released between the copy's listing and its read of that hold failed
    the copy (a fresh-clone CI run lost a drill to it): only `zero/` is copied down."""
    import os

    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from shardyard.storage.store import RunStorage
    from shardyard.checkpoint.formats.zero import local_zero_files

    class ReleasedWhileCopied(LocalFileSystem):
        """The local disk as an object store on which every hold is released as it is copied."""

        protocol = ("released",)

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(str(path).removeprefix("released://"))

        def get_file(self, rpath, lpath, **kwargs):
            if "/holds/" in str(rpath):
                os.remove(rpath)
            return super().get_file(rpath, lpath, **kwargs)

    fsspec.register_implementation("released", ReleasedWhileCopied, clobber=True)
    checkpoint = tmp_path / "run" / "checkpoint_step_00000002"
    (checkpoint / "zero").mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, checkpoint / "zero" / "mp_rank_00_model_states.pt")
    (checkpoint / "holds").mkdir()
    (checkpoint / "holds" / "another-rank.json").write_text("{}")

    with local_zero_files(RunStorage(f"released://{tmp_path / 'run'}"), checkpoint.name) as zero:
        assert zero.name == "zero" and zero != checkpoint / "zero"  # a copy, as from a bucket
        assert [p.name for p in zero.iterdir()] == ["mp_rank_00_model_states.pt"]
        assert torch.load(zero / "mp_rank_00_model_states.pt", weights_only=True)["w"].tolist() == [1.0, 1.0]


class _RunsCode:
    """A pickle that runs a command when it is loaded without an allow-list."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.mark.timeout(60)
def test_deepspeed_loads_the_zero_files_that_were_checked_not_ones_swapped_after(tmp_path: Path,
                                                                                monkeypatch) -> None:
    """DeepSpeed unpickles its files unrestricted, so they are checked first. Whoever can write
    the run's directory swaps a file right after the check: the load must read the checked bytes
    (a private copy), not the swapped ones, which would run their code."""
    import pickle

    from shardyard.checkpoint.formats import zero as zero_format
    from shardyard.storage.store import RunStorage

    checkpoint = tmp_path / "run" / "checkpoint_step_00000002"
    shared = checkpoint / "zero" / "mp_rank_00_model_states.pt"
    shared.parent.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, shared)
    marker, check = tmp_path / "code_ran", zero_format.check_zero_files

    def checked_then_swapped(directory: Path) -> None:
        check(directory)
        shared.write_bytes(pickle.dumps(_RunsCode(str(marker))))  # the attacker, just after the check

    monkeypatch.setattr(zero_format, "check_zero_files", checked_then_swapped)
    with zero_format.local_zero_files(RunStorage(str(tmp_path / "run")), checkpoint.name) as zero:
        loaded = torch.load(zero / shared.name, weights_only=False)  # as DeepSpeed loads its files
    assert not marker.exists()
    assert loaded["w"].tolist() == [1.0, 1.0]


@pytest.mark.timeout(60)
def test_nine_digit_steps_are_compared_as_numbers(tmp_path: Path) -> None:
    """Step 100,000,000 is the first with nine digits: compared as names, every eight-digit step
    from 2 up sorted after it, and a restore of it set aside every older good checkpoint as bad."""
    spec = spec_for(tmp_path)
    engine = engine_for(spec)
    manager = CheckpointManager(spec.run_uri, keep=3)
    for step in (99_999_990, 100_000_000):
        manager.save(engine, TrainState(step, 8 * step, 1), spec)
    run = tmp_path / "run"
    assert manager.restore(engine_for(spec)).step == 100_000_000
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint_step_")) == [
        "checkpoint_step_100000000", "checkpoint_step_99999990"]
    manager.save(engine, TrainState(100_000_010, 8, 1), spec)
    manager.save(engine, TrainState(100_000_020, 8, 1), spec)  # keep 3: the eight-digit one goes
    assert [p.name for p in sorted(run.glob("checkpoint_step_*"))] == [
        "checkpoint_step_100000000", "checkpoint_step_100000010", "checkpoint_step_100000020"]


@pytest.mark.timeout(60)
def test_export_and_serving_hand_deepspeed_the_checked_zero_files_too(tmp_path: Path, monkeypatch) -> None:
    """Training's restore loaded a private copy of the ZeRO files it checked, but export and the
    serving shards scanned the live directory and let DeepSpeed open it again: a file swapped
    after the scan ran its code. Every path now loads the checked copy."""
    import pickle

    from shardyard.checkpoint import loaders
    from shardyard.checkpoint.formats import zero as zero_format
    from shardyard.checkpoint.record import entry, make_record

    spec = spec_for(tmp_path)
    checkpoint = tmp_path / "run" / "checkpoint_step_00000002"
    shared = checkpoint / "zero" / "mp_rank_00_model_states.pt"
    shared.parent.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, shared)
    (checkpoint / "spec.json").write_text(spec.model_dump_json())
    files = {"spec.json": entry((checkpoint / "spec.json").read_bytes()), "zero/mp_rank_00_model_states.pt":
             entry(shared.read_bytes())}
    (checkpoint / COMMIT_FILE).write_text(json.dumps(make_record(2, 1, "deepspeed", files, 0.0)))
    marker, check = tmp_path / "code_ran", zero_format.check_zero_files

    def checked_then_swapped(directory: Path) -> None:
        check(directory)
        shared.write_bytes(pickle.dumps(_RunsCode(str(marker))))  # the attacker, just after the check

    monkeypatch.setattr(zero_format, "check_zero_files", checked_then_swapped)
    monkeypatch.setattr(loaders, "check_zero_files", checked_then_swapped, raising=False)  # where it was called
    for load in (lambda: loaders.load_model(checkpoint, verify=False),
                 lambda: loaders.load_model_part(checkpoint, lambda model: model, torch.device("cpu"))):
        torch.save({"w": torch.ones(2)}, shared)
        with pytest.raises(Exception):  # not a whole DeepSpeed checkpoint: DeepSpeed refuses the copy
            load()
        assert not marker.exists()


def zero_save_recording_flushes(rank: int, world: int, storage: str) -> list[str]:
    """Train ZeRO-2 to its first checkpoint; the names of the files this rank flushed to disk."""
    from shardyard.storage import store
    from helpers.oracle import job, train, with_storage

    flushed: list[str] = []
    real = store.fsync_path

    def recorded(path: str) -> None:
        flushed.append(os.path.basename(path))
        real(path)

    store.fsync_path = recorded
    train(rank, world, with_storage(job({"strategy": "zero2"}, world, 4), Path(storage), steps=2))
    return flushed


@pytest.mark.timeout(240)
def test_every_rank_flushes_its_own_zero_partition_before_the_commit(tmp_path: Path) -> None:
    """DeepSpeed writes each rank's partition on that rank's node; rank 0's flush at commit
    reaches its own node's writes only (a file system shared by nodes). Each rank flushes its own."""
    from shardyard.localdist import run_distributed

    for rank, flushed in enumerate(run_distributed(zero_save_recording_flushes, 2, str(tmp_path))):
        assert f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in flushed, (rank, flushed)
