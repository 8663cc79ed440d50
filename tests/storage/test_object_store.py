"""Object storage through a real S3 protocol: moto's standalone S3 server on a local port, reached
over HTTP by s3fs exactly as a bucket would be (only AWS_ENDPOINT_URL says where). Token shards
are read from the bucket and checkpoints written to it and read back, across ZeRO's own format,
a resize and a change of strategy; the chain must equal one process training on the same data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shardyard.checkpoint.record import newest_name
from shardyard.data.prepare import SplitWriter
from shardyard.data.shards import write_index
from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import single_process
from shardyard.spec import parse_spec
from shardyard.checkpoint.manager import CheckpointManager
from shardyard.storage.store import RunStorage
from helpers.buckets import Bucket
from helpers.oracle import steps, train

VOCAB = 64


def publish_shards(fs, local: Path) -> np.ndarray:
    """Token shards written locally and copied to s3://bucket/data (as `aws s3 sync` would)."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=6_000, dtype=np.uint32)
    writer = SplitWriter(local, "train", np.dtype("<u2"), shard_tokens=1024)
    writer.add(tokens)
    write_index(local, np.dtype("<u2"), VOCAB, {"train": writer.close()})
    fs.put(f"{local}/", "bucket/data", recursive=True)
    return tokens


def job(tmp_path: Path, strategy: str, until: int) -> dict:
    return {"model": {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": VOCAB},
            "data": {"name": "shards", "path": "s3://bucket/data", "cache_dir": str(tmp_path / "cache"),
                     "cache_bytes": 1 << 20},
            # Plain SGD: a wrong gradient scale anywhere in the chain changes the parameters.
            "optim": {"name": "sgd", "lr": 0.5, "momentum": 0.0, "grad_clip": 0.0, "warmup_steps": 1,
                      "schedule": "constant"},
            "batch": {"global_batch_size": 8, "micro_batch_size": 4},
            "parallelism": {"strategy": strategy},
            "checkpoint": {"storage_path": "s3://bucket/runs", "every_n_steps": 2},
            "run": {"name": "run", "steps": until}}


@pytest.mark.timeout(300)
def test_shards_and_checkpoints_in_a_bucket_train_as_one_process_would(bucket: Bucket, tmp_path: Path) -> None:
    """ZeRO-2 on 2 ranks to step 4 (DeepSpeed's files uploaded), ZeRO-2 on 1 rank to step 6 (the
    step-4 checkpoint downloaded and resharded through DeepSpeed's universal format), DDP on 2
    ranks to step 8 (a ZeRO checkpoint read into torch modules; DCP written to the bucket), read
    back in one process from the bucket: the parameters of one process's 8 steps."""
    (tmp_path / "prepared").mkdir()
    publish_shards(bucket.fs, tmp_path / "prepared")
    for strategy, world, until in [("zero2", 2, 4), ("zero2", 1, 6), ("ddp", 2, 8)]:
        run_distributed(train, world, job(tmp_path, strategy, until))
        assert newest_name(RunStorage("s3://bucket/runs/run")) == f"checkpoint_step_{until:08d}"
    assert not bucket.fs.exists("bucket/runs/run/checkpoint_step_00000002")  # pruned: keep 2

    spec = parse_spec({**job(tmp_path, "ddp", 8), "batch": {"global_batch_size": 8, "micro_batch_size": 8},
                       "scaling": {"num_workers": 1}})
    torch.manual_seed(spec.run.seed)
    expected = single_process(spec, build_model(spec.model), torch.device("cpu"))
    steps(expected, spec, 0, 8)
    got = single_process(spec, build_model(spec.model), torch.device("cpu"))
    assert CheckpointManager(spec.run_uri, keep=2).restore(got).step == 8
    for (name, value), (_, trained) in zip(expected.model.named_parameters(), got.model.named_parameters()):
        torch.testing.assert_close(trained, value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.timeout(120)
def test_the_run_lease_on_a_bucket_admits_one_holder_by_conditional_write(bucket: Bucket) -> None:
    """On object storage a lease generation is taken by a PUT with `If-None-Match: *`: a second
    writer of the same generation is refused by the store itself, and fencing sees the holder."""
    from shardyard.checkpoint.lease import LeaseHeld, LeaseLost, RunLease, current_lease

    storage = RunStorage("s3://bucket/runs/leased")
    assert storage.create_exclusive(b"{}", "probe") is True
    assert storage.create_exclusive(b"{}", "probe") is False  # the store refused the second PUT
    first = RunLease("s3://bucket/runs/leased", "leased", ttl_s=3.0)
    first.acquire()
    try:
        with pytest.raises(LeaseHeld):
            RunLease("s3://bucket/runs/leased", "leased", ttl_s=3.0).acquire()  # renewed: held
        assert current_lease(storage)["id"] == first.id
        taker = RunLease("s3://bucket/runs/leased", "leased", ttl_s=3.0)
        taker.acquire(take_over=True)
        with pytest.raises(LeaseLost):
            first.fence()()
        taker.release()
    finally:
        first.release()
