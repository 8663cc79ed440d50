"""A restore reads each checkpoint file once: its checksum is checked as it is loaded
(checkpoint/verified_reads.py), and a file that does not match, on whichever rank reads it, makes
every rank fall back to the previous checkpoint together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardyard.checkpoint import manager as manager_module
from shardyard.checkpoint import record as record_module
from shardyard.checkpoint import verified_reads
from shardyard.checkpoint.layout import TrainState
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.checkpoint.record import COMMIT_FILE, checkpoint_name
from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine, single_process
from shardyard.spec import parse_spec

pytestmark = pytest.mark.timeout(120)


def spec_for(storage: Path, strategy: str = "ddp", world: int = 1):
    return parse_spec({"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
                       "data": {"name": "synthetic", "num_samples": 64}, "parallelism": {"strategy": strategy},
                       "scaling": {"num_workers": world}, "batch": {"global_batch_size": 8, "micro_batch_size": 4},
                       "checkpoint": {"storage_path": str(storage), "keep": 3}, "run": {"name": "run"}})


def test_a_restore_checks_each_file_once_as_it_loads_it(tmp_path: Path, monkeypatch) -> None:
    spec = spec_for(tmp_path)
    torch.manual_seed(0)
    engine = single_process(spec, build_model(spec.model), torch.device("cpu"))
    CheckpointManager(spec.run_uri, keep=3).save(engine, TrainState(2, 16, 1), spec)
    checked: list[str] = []

    def counted(data, expected, where: str) -> None:
        checked.append(Path(where).name)
        check_entry(data, expected, where)

    def no_separate_pass(*args, **kwargs):
        raise AssertionError("the files were read for their checksums before loading")

    check_entry = verified_reads.check_entry
    monkeypatch.setattr(verified_reads, "check_entry", counted)
    monkeypatch.setattr(manager_module, "check_entry", counted)
    monkeypatch.setattr(record_module, "file_entry", no_separate_pass)
    fresh = single_process(spec, build_model(spec.model), torch.device("cpu"))
    assert CheckpointManager(spec.run_uri, keep=3).restore(fresh).step == 2
    listed = json.loads((tmp_path / "run" / checkpoint_name(2) / COMMIT_FILE).read_text())["files"]
    assert sorted(set(checked)) == sorted(listed)
    assert all(checked.count(name) == 1 for name in listed if name != ".metadata")  # DCP opens .metadata twice
    for name, value in engine.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], value), name


def flip_and_restore(rank: int, world: int, storage: str) -> int:
    """FSDP over 2 ranks saves steps 2 and 4; rank 1's own shard of step 4 gets flipped bytes,
    which only rank 1 reads; every rank restores."""
    spec = spec_for(Path(storage), "fsdp", world)
    torch.manual_seed(0)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    manager = CheckpointManager(spec.run_uri, keep=3)
    for step in (2, 4):
        manager.save(engine, TrainState(step, 8 * step, world), spec)
    if rank == 0:
        shard = Path(storage, "run", checkpoint_name(4), "__1_0.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    fresh = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    return CheckpointManager(spec.run_uri, keep=3).restore(fresh).step


def test_a_shard_only_one_rank_reads_fails_every_rank_over_to_the_previous_checkpoint(tmp_path: Path) -> None:
    assert run_distributed(flip_and_restore, 2, str(tmp_path)) == [2, 2]
    (bad,) = (tmp_path / "run").glob(f"{checkpoint_name(4)}.bad-*")
    assert (bad / "__1_0.distcp").exists()
