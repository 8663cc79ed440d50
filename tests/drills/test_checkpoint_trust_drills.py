"""Drills: the failures checkpoints exist for, and what shardyard must do about them.

Torn and corrupted checkpoints, a checkpoint that would run code, two launches racing for one
run, a launch frozen past its lease. Each names its expected outcome on its `drill` marker
(benchmarks/drills.py tabulates them). None needs Ray: they act on the checkpoint core directly,
or on `shardyard export` run as the command's own function.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.lease import LeaseHeld, RunLease, current_lease
from shardyard.checkpoint.loaders import find_latest
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.record import COMMIT_FILE, entry
from shardyard.storage.store import RunStorage
from shardyard.cli.export import run_export
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec

pytestmark = pytest.mark.timeout(180)


def spec_for(storage: Path, **run: object):
    return parse_spec({"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
                       "data": {"name": "synthetic", "num_samples": 64}, "scaling": {"num_workers": 1},
                       "batch": {"global_batch_size": 8, "micro_batch_size": 8},
                       "checkpoint": {"storage_path": str(storage), "keep": 3}, "run": {"name": "run", **run}})


def two_checkpoints(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run with committed checkpoints at steps 2 and 4 of different weights; the step-2 weights."""
    spec = spec_for(tmp_path)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    manager = CheckpointManager(spec.run_uri, keep=3)
    manager.save(engine, TrainState(2, 16, 1), spec)
    at_two = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with torch.no_grad():
        for p in engine.model.parameters():
            p.add_(1.0)
    manager.save(engine, TrainState(4, 32, 1), spec)
    return Path(spec.run_uri), at_two


def exported(run: Path, out: Path, capsys: pytest.CaptureFixture, what: Path | None = None) -> tuple[int, str]:
    code = run_export(str(what or run), str(out), "safetensors")
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def assert_exported_step_two(out: Path, at_two: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file

    got = load_file(str(out))
    for name, value in got.items():
        torch.testing.assert_close(value, at_two[name], rtol=0, atol=0)


@pytest.mark.drill(outcome="recovered", lost="the damaged checkpoint only")
@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_a_torn_commit_record_falls_back_to_the_previous_checkpoint(tmp_path: Path, damage: str, capsys,
                                                                   caplog) -> None:
    """What a power cut can leave after a rename whose data never reached the disk: every reader
    names the bad record and uses the newest good checkpoint; none raises a traceback."""
    run, at_two = two_checkpoints(tmp_path)
    record = run / "checkpoint_step_00000004" / COMMIT_FILE
    text = record.read_bytes()
    record.write_bytes({"empty": b"", "truncated": text[: len(text) // 2], "garbage": b"\x00" * 40}[damage])
    code, _ = exported(run, tmp_path / "out.safetensors", capsys)
    assert code == 0
    assert str(record) in caplog.text
    assert_exported_step_two(tmp_path / "out.safetensors", at_two)
    assert find_latest(run).name == "checkpoint_step_00000002"
    spec = spec_for(tmp_path)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    assert CheckpointManager(spec.run_uri, keep=3).restore(engine).step == 2


@pytest.mark.drill(outcome="recovered", lost="the damaged checkpoint only")
def test_flipped_bytes_in_a_shard_are_found_and_the_previous_checkpoint_is_used(tmp_path: Path, capsys,
                                                                               caplog) -> None:
    run, at_two = two_checkpoints(tmp_path)
    shard = run / "checkpoint_step_00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 32] = bytes(b ^ 0xFF for b in data[middle:middle + 32])
    shard.write_bytes(bytes(data))
    code, _ = exported(run, tmp_path / "out.safetensors", capsys)
    assert code == 0 and f"{shard} does not match its checksum" in caplog.text
    assert_exported_step_two(tmp_path / "out.safetensors", at_two)
    # Named directly, the bad checkpoint is refused with the file's name, not loaded.
    code, err = exported(run, tmp_path / "direct.safetensors", capsys, what=shard.parent)
    assert code == 2 and f"{shard} does not match its checksum" in err and "Traceback" not in err
    assert not (tmp_path / "direct.safetensors").exists()
    # Training resumes from step 2 and sets the bad step 4 aside, so it writes step 4 afresh.
    spec = spec_for(tmp_path)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    manager = CheckpointManager(spec.run_uri, keep=3)
    assert manager.restore(engine).step == 2
    (bad,) = run.glob("checkpoint_step_00000004.bad-*")
    assert (bad / "__0_0.distcp").exists()
    manager.save(engine, TrainState(4, 32, 1), spec)
    assert find_latest(run).name == "checkpoint_step_00000004"


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_metadata_file_that_would_run_code_is_refused_without_running_it(tmp_path: Path, capsys) -> None:
    """Whoever can write into a run directory can rewrite a checkpoint and its commit record whole:
    the checksums then match, and loading must still run no code from it."""
    run, _ = two_checkpoints(tmp_path)
    marker = tmp_path / "code_ran"
    checkpoint = run / "checkpoint_step_00000004"
    evil = pickle.dumps(_RunsCode(str(marker)))
    (checkpoint / ".metadata").write_bytes(evil)
    record = json.loads((checkpoint / COMMIT_FILE).read_text())
    record["files"][".metadata"] = entry(evil)
    (checkpoint / COMMIT_FILE).write_text(json.dumps(record))
    code, err = exported(run, tmp_path / "out.safetensors", capsys)
    assert code == 2 and "would run code if unpickled" in err and "posix.system" in err, err
    assert "Traceback" not in err
    assert not marker.exists()


def _race(run_dir: str, barrier, results) -> None:
    lease = RunLease(run_dir, "run", ttl_s=0.6)
    barrier.wait()
    try:
        lease.acquire()
        results.put(("held", lease.generation))
    except LeaseHeld:
        results.put(("refused", 0))
    barrier.wait()  # the holder stays until the other has its answer
    lease.release()


@pytest.mark.drill(outcome="refused", lost="nothing")
@pytest.mark.timeout(300)
def test_two_launches_at_once_never_both_hold_the_run(tmp_path: Path) -> None:
    """Two launches released together by one barrier, 100 times: exactly one holds the run each
    time (a read-then-write lease let both in 26 times in 40)."""
    context = multiprocessing.get_context("fork")
    for trial in range(100):
        barrier, results = context.Barrier(2), context.Queue()
        racers = [context.Process(target=_race, args=(str(tmp_path / f"run{trial}"), barrier, results))
                  for _ in range(2)]
        for racer in racers:
            racer.start()
        outcomes = sorted(results.get(timeout=30)[0] for _ in racers)
        for racer in racers:
            racer.join(timeout=30)
        assert outcomes == ["held", "refused"], f"trial {trial}: {outcomes}"


FROZEN = """
import sys, time, torch
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.lease import LeaseLost, RunLease
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec

spec = parse_spec({"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
                   "data": {"name": "synthetic", "num_samples": 64}, "scaling": {"num_workers": 1},
                   "batch": {"global_batch_size": 8, "micro_batch_size": 8},
                   "checkpoint": {"storage_path": sys.argv[1], "keep": 100}, "run": {"name": "run"}})
lease = RunLease(spec.run_uri, "run", ttl_s=1.5)
lease.acquire()
manager = CheckpointManager(spec.run_uri, keep=100, fence=lease.fence())
engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
step = 0
try:
    while True:
        step += 1
        manager.save(engine, TrainState(step, 8 * step, 1), spec)
        print("committed", step, flush=True)
        time.sleep(0.2)
except LeaseLost as err:
    print("lost", step, err, flush=True)
    sys.exit(3)
"""


@pytest.mark.drill(outcome="recovered", lost="nothing")
def test_a_holder_frozen_past_its_lease_stops_without_committing_once_thawed(tmp_path: Path) -> None:
    """A launch frozen (SIGSTOP: a stalled VM, a debugger) past its lease is taken over; thawed,
    it finds its generation gone and stops at its next commit, writing nothing: no split brain."""
    holder = subprocess.Popen([sys.executable, "-c", FROZEN, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        while True:
            line = holder.stdout.readline().split()
            assert line, "the holder ended before committing"
            if line[:2] == ["committed", "3"]:
                break
        os.kill(holder.pid, signal.SIGSTOP)
        run = tmp_path / "run"
        frozen_at = RunStorage(str(run)).checkpoint_names()  # not a save in flight
        start = time.monotonic()
        taker = RunLease(str(run), "run", ttl_s=1.5)
        taker.acquire()  # the frozen holder's record stops changing: gone after its ttl, by our clock
        assert time.monotonic() - start >= 1.5 and current_lease(taker.storage)["id"] == taker.id
        os.kill(holder.pid, signal.SIGCONT)
        out, _ = holder.communicate(timeout=60)
        assert holder.returncode == 3 and out.startswith("lost"), out
        # Nothing committed (or pruned) after the takeover: at most the step it was frozen in.
        after = sorted(p.name for p in run.glob("checkpoint_step_*") if (p / COMMIT_FILE).exists())
        assert set(after) <= set(frozen_at) | {f"checkpoint_step_{int(frozen_at[-1][-8:]) + 1:08d}"}
        assert set(frozen_at) <= set(after)
        taker.release()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
        holder.wait()


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_factory_named_by_a_stored_spec_is_never_imported_unasked(tmp_path: Path, capsys, monkeypatch) -> None:
    """A run directory's spec.json can name any module as the model factory: reading the
    checkpoint imports nothing it names unless the user names the same factory."""
    run, _ = two_checkpoints(tmp_path)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    marker = tmp_path / "imported"
    (plugins / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef build(spec): raise SystemExit\n")
    monkeypatch.syspath_prepend(str(plugins))
    checkpoint = run / "checkpoint_step_00000004"
    stored = json.loads((checkpoint / "spec.json").read_text())
    stored["model"] = {"name": "custom", "factory": "planted:build", "block_size": 8, "vocab_size": 256}
    data = json.dumps(stored).encode()
    (checkpoint / "spec.json").write_bytes(data)
    record = json.loads((checkpoint / COMMIT_FILE).read_text())
    record["files"]["spec.json"] = entry(data)
    (checkpoint / COMMIT_FILE).write_text(json.dumps(record))
    code, err = exported(run, tmp_path / "out.safetensors", capsys)
    assert code == 2 and "--trust-factory planted:build" in err and "Traceback" not in err, err
    assert not marker.exists()


KILLED_AT_COMMIT = """
import os, signal, sys, torch
from shardyard.checkpoint import manager as checkpoints
from shardyard.checkpoint.layout import TrainState
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec

spec = parse_spec({"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
                   "data": {"name": "synthetic", "num_samples": 64}, "scaling": {"num_workers": 1},
                   "batch": {"global_batch_size": 8, "micro_batch_size": 8},
                   "checkpoint": {"storage_path": sys.argv[1]}, "run": {"name": "run"}})
engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
manager = checkpoints.CheckpointManager(spec.run_uri, keep=2)
manager.save(engine, TrainState(2, 16, 1), spec)
# kill -9 at the moment of the next commit: its data files are written, its record is not
checkpoints.commit = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
manager.save(engine, TrainState(4, 32, 1), spec)
"""


@pytest.mark.drill(outcome="recovered", lost="the steps since the last commit")
def test_a_kill_during_a_commit_leaves_the_previous_checkpoint_and_the_run_resumes(tmp_path: Path) -> None:
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_COMMIT, str(tmp_path)], capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run = tmp_path / "run"
    (written,) = run.glob("checkpoint_step_00000004.attempt-*")  # written under a name of its own
    assert (written / "__0_0.distcp").exists() and not (run / "checkpoint_step_00000004").exists()
    assert find_latest(run).name == "checkpoint_step_00000002"
    spec = spec_for(tmp_path)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    manager = CheckpointManager(spec.run_uri, keep=2)
    assert manager.restore(engine).step == 2
    manager.save(engine, TrainState(4, 32, 1), spec)  # written again whole, under a name of its own
    assert find_latest(run).name == "checkpoint_step_00000004"


@pytest.mark.drill(outcome="recovered", lost="nothing")
def test_pruning_touches_only_the_names_the_run_writes(tmp_path: Path) -> None:
    run, _ = two_checkpoints(tmp_path)
    (run / "checkpoint_step_00000002.bak").mkdir()  # the user's copy
    (run / "checkpoint_step_00000002.bak" / "notes.txt").write_text("mine")
    spec = spec_for(tmp_path)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    record = run / "checkpoint_step_00000004" / COMMIT_FILE
    record.write_bytes(b"")  # a damaged record counts as uncommitted: cleared once a newer one commits
    manager = CheckpointManager(spec.run_uri, keep=1)
    manager.save(engine, TrainState(6, 48, 1), spec)
    assert (run / "checkpoint_step_00000002.bak" / "notes.txt").read_text() == "mine"
    assert find_latest(run).name == "checkpoint_step_00000006"
    assert sorted(p.name for p in run.glob("checkpoint_step_*")) == ["checkpoint_step_00000002.bak",
                                                                     "checkpoint_step_00000006"]


def outside_entry(tmp_path: Path) -> tuple[str, dict[str, int]]:
    """A file beside the run, and the record entry a hostile record gives it (its true size and
    checksum: a reader that follows the name finds it matching)."""
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not the checkpoint's")
    return "../../outside.txt", entry(outside.read_bytes())


@pytest.mark.drill(outcome="recovered", lost="the damaged checkpoint only")
@pytest.mark.parametrize("damage", ["wrong_types", "file_outside", "linked_folder", "no_file_list"])
def test_a_record_that_parses_but_cannot_be_trusted_falls_back_with_a_reason(tmp_path: Path, damage: str,
                                                                              caplog) -> None:
    """JSON-valid records no commit wrote: fields of the wrong type, a file named outside the
    checkpoint (with its true size and checksum), no file list (nothing to verify). Each is named
    with its reason and the previous checkpoint is used; none raises, none loads unverified."""
    run, _ = two_checkpoints(tmp_path)
    path = run / "checkpoint_step_00000004" / COMMIT_FILE
    record = json.loads(path.read_text())
    if damage == "wrong_types":
        record["world_size"], record["files"] = "one", {name: "big" for name in record["files"]}
    elif damage == "file_outside":
        name, given = outside_entry(tmp_path)
        record["files"][name] = given
    elif damage == "linked_folder":  # a name inside the checkpoint, a folder elsewhere behind it
        _, given = outside_entry(tmp_path)
        (path.parent / "linked").symlink_to(tmp_path)
        record["files"]["linked/outside.txt"] = given
    else:
        record["version"] = 1
        del record["files"]
    path.write_text(json.dumps(record))
    assert find_latest(run).name == "checkpoint_step_00000002"
    reason = {"wrong_types": "of the wrong type", "file_outside": "names a file outside its checkpoint",
              "linked_folder": "leads outside its checkpoint through a symbolic link",
              "no_file_list": "lists no files"}[damage]
    named = path.parent / "linked" / "outside.txt" if damage == "linked_folder" else path
    assert reason in caplog.text and str(named) in caplog.text
    spec = spec_for(tmp_path)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    assert CheckpointManager(spec.run_uri, keep=3).restore(engine).step == 2


@pytest.mark.drill(outcome="refused", lost="nothing")
def test_a_file_swapped_after_serving_verified_the_checkpoint_is_refused_as_it_is_read(tmp_path: Path) -> None:
    """Serving verifies the checkpoint it picks (`servable`), then its shards read it; a writer of
    the run who swaps a file in between (another checkpoint's weights: valid, only not these)
    must not have them served. Every read is checked against the record that was judged."""
    from shardyard.checkpoint.loaders import load_model, load_model_part, servable
    from shardyard.checkpoint.record import BadCheckpoint

    run, _ = two_checkpoints(tmp_path)
    chosen = servable(run)
    assert chosen.name == "checkpoint_step_00000004"
    swapped = sorted(chosen.glob("*.distcp"))
    assert swapped
    for data in swapped:
        data.write_bytes((run / "checkpoint_step_00000002" / data.name).read_bytes())
    for load in (lambda: load_model(chosen, verify=False),  # the MLP's replica, `shardyard export`
                 lambda: load_model_part(chosen, lambda model: model, torch.device("cpu"))):  # a shard
        with pytest.raises(BadCheckpoint, match=swapped[0].name):
            load()


@pytest.mark.drill(outcome="recovered", lost="nothing")
def test_steps_of_nine_digits_and_more_are_checkpoints_like_any_other(tmp_path: Path) -> None:
    """A long run (or one resumed with a large step) passes 99,999,999: its checkpoints' names
    grow a ninth digit, and they are still found, ordered by step, restored and pruned."""
    spec = spec_for(tmp_path)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    manager = CheckpointManager(spec.run_uri, keep=2)
    for step in (99_999_998, 100_000_000, 100_000_002):
        manager.save(engine, TrainState(step, step * 8, 1), spec)
    run = Path(spec.run_uri)
    assert find_latest(run).name == "checkpoint_step_100000002"
    assert sorted(p.name for p in run.glob("checkpoint_step_*")) == ["checkpoint_step_100000000",
                                                                     "checkpoint_step_100000002"]
    assert manager.restore(engine).step == 100_000_002


@pytest.mark.drill(outcome="refused", lost="nothing")
@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_dcp_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path: Path, where: str, capsys) -> None:
    """A `.metadata` rewritten (and its record with it, so the checksums match) to send DCP's
    reads to a file outside the checkpoint: refused by name, nothing read from there."""
    import dataclasses
    import io

    from shardyard.checkpoint.safe_load import read_metadata

    run, _ = two_checkpoints(tmp_path)
    checkpoint = run / "checkpoint_step_00000004"
    target = next(checkpoint.glob("*.distcp"))
    outside = tmp_path / "elsewhere.distcp"
    outside.write_bytes(target.read_bytes())  # the same bytes: only the name tells it apart
    metadata = read_metadata(io.BytesIO((checkpoint / ".metadata").read_bytes()), "metadata")
    name = str(outside) if where == "absolute" else f"../../{outside.name}"
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=name)
                             for index, info in metadata.storage_data.items()}
    rewritten = pickle.dumps(metadata)
    (checkpoint / ".metadata").write_bytes(rewritten)
    record = json.loads((checkpoint / COMMIT_FILE).read_text())
    record["files"][".metadata"] = entry(rewritten)
    (checkpoint / COMMIT_FILE).write_text(json.dumps(record))
    code, err = exported(run, tmp_path / "out.safetensors", capsys, checkpoint)
    assert code == 2 and "not a file of this checkpoint" in err and name in err, err
    assert "Traceback" not in err
