"""Plain PyTorch DDP under torchrun: the baseline for ddp_overhead.py.

Same model, data, sample order, batch sizes and optimizer as shardyard's job spec, written the
way one would without shardyard: init_process_group, DDP, no_sync accumulation, clip, AdamW.
Rank 0 writes per-step wall times to the JSON path given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import common  # noqa: F401  (puts the package on sys.path)
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardyard.layout.world_size import grad_accum_steps
from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.models import build_model, loss_fn_for
from shardyard.spec import load_spec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = load_spec(args.config, args.overrides)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.run.seed)
    model = DistributedDataParallel(build_model(spec.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.optim.lr, betas=spec.optim.betas,
                                  weight_decay=spec.optim.weight_decay)
    loss_fn = loss_fn_for(spec)
    dataset = build_dataset(spec)
    order = GlobalSampleOrder(len(dataset), spec.run.seed)
    accum = grad_accum_steps(spec, world)

    step_times = []
    for step in range(spec.run.steps):
        start = time.perf_counter()
        ids = micro_batch_ids(order, step * spec.batch.global_batch_size, rank, world,
                              spec.batch.micro_batch_size, accum)
        for i, sample_ids in enumerate(ids):
            inputs, targets = dataset.batch(sample_ids)
            sync = contextlib.nullcontext() if i == accum - 1 else model.no_sync()
            with sync:
                (loss_fn(model(inputs), targets) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"step_times": step_times}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
