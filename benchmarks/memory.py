"""Per-rank memory of parameters, gradients and optimizer state, measured, for DDP, ZeRO-1/2/3 and
FSDP at world sizes 1, 2 and 4, beside the ZeRO paper's fp32 Adam formula (Psi parameters,
N ranks): DDP 16 Psi, stage 1 8 Psi + 8 Psi/N, stage 2 4 Psi + 12 Psi/N, stage 3 and FSDP 16 Psi/N,
and beside the estimate of `shardyard plan` (planner.py), which models DeepSpeed's extra copies.
Targets: measured/formula within 10%, measured/planner within 15% (tests/test_planner.py checks
the latter). Also each rank's peak resident memory.

How it measures: after one warm-up step, each rank runs forward and backward of the next step
and stops before the optimizer step, when parameters, gradients and optimizer state are all
resident. It then walks every live tensor (Python's gc), counts each storage once, and files it
as a parameter (the model's local shards), optimizer state (the optimizer's state tensors and the
master copies it steps) or gradient (everything else live: .grad tensors, ZeRO's reduction
buffers). Tensors held only inside C++ (DDP's reducer buckets) are invisible to this walk.

What it found on CPU (fp32): DDP and FSDP within 1% of the formula. ZeRO runs above it, for
two reasons the formula leaves out: DeepSpeed keeps an fp32 master copy of each optimizer
partition even when the model itself is fp32 (+4 Psi/N, filed under optimizer state; in the
paper's mixed-precision accounting that copy is part of K = 12), and it allocates fixed-size
communication buckets (filed under gradients; shardyard caps them at the model's size).

    python benchmarks/memory.py [--worlds 1 2 4]
"""

from __future__ import annotations

import argparse
import gc
import resource

import common  # noqa: F401  (puts the package on sys.path)
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common import print_table, write_json
from shardyard.layout.world_size import grad_accum_steps
from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.planner import ModelShape, estimate
from shardyard.spec import parse_spec

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
FORMULA = {  # bytes per parameter, fp32 Adam, as a function of N
    "ddp": lambda n: 16, "zero1": lambda n: 8 + 8 / n, "zero2": lambda n: 4 + 12 / n,
    "zero3": lambda n: 16 / n, "fsdp": lambda n: 16 / n,
}


def job(strategy: str, world: int) -> dict:
    return {"model": {"n_layer": 4, "n_head": 4, "n_embd": 256, "block_size": 32},
            "data": {"name": "synthetic", "num_samples": 512},
            "optim": {"grad_clip": 0.0},
            "batch": {"global_batch_size": 8, "micro_batch_size": 8 // world},
            "parallelism": {"strategy": strategy}, "scaling": {"num_workers": world}}


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    if isinstance(t, DTensor):
        t = t.to_local()
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (s.data_ptr(), s.nbytes()) if s.nbytes() else None


def _storages(tensors) -> dict[int, int]:
    return dict(filter(None, (_storage(t) for t in tensors)))


def measure(rank: int, world: int, raw: dict) -> dict:
    spec = parse_spec(raw)
    torch.manual_seed(0)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    dataset = build_dataset(spec)
    order = GlobalSampleOrder(len(dataset), 0)
    accum = grad_accum_steps(spec, world)
    batch = lambda step: [dataset.batch(i) for i in micro_batch_ids(  # noqa: E731
        order, step * spec.batch.global_batch_size, engine.dp_rank, engine.dp_size,
        spec.batch.micro_batch_size, accum)]
    engine.train_step(batch(0))  # optimizer state now exists

    ds = getattr(engine, "ds", None)  # ZeRO engines wrap DeepSpeed's
    if ds is not None:
        for x, y in batch(1):
            ds.backward(engine.loss_fn(ds(x), y))
        zero_opt = ds.optimizer
        params = [getattr(p, "ds_tensor", p) for p in ds.module.parameters()]
        masters = (getattr(zero_opt, "single_partition_of_fp32_groups", None)
                   or getattr(zero_opt, "fp32_partitioned_groups_flat", []))
        torch_opt = zero_opt.optimizer
    else:
        engine.forward_backward(batch(1))
        params = engine.parameters()
        masters, torch_opt = [], engine.optimizers[0]

    param_bytes = _storages(params)
    optim_bytes = _storages([v for s in torch_opt.state.values() for v in s.values() if torch.is_tensor(v)]
                            + list(masters))
    optim_bytes = {k: v for k, v in optim_bytes.items() if k not in param_bytes}
    gc.collect()
    # .grad wrappers exist in Python only once accessed: take them explicitly, then the rest.
    grads = [p.grad for p in params if p.grad is not None]
    live = _storages([*grads, *(o for o in gc.get_objects() if torch.is_tensor(o))])
    data = _storages([t for mb in batch(1) for t in mb])
    grad_bytes = {k: v for k, v in live.items() if k not in param_bytes and k not in optim_bytes and k not in data}
    psi = sum(p.numel() for p in build_model(spec.model).parameters())
    dist.barrier()
    return {"params": sum(param_bytes.values()), "grads": sum(grad_bytes.values()),
            "optim": sum(optim_bytes.values()), "psi": psi,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES)
    args = parser.parse_args()
    rows = []
    for strategy in args.strategies:
        for world in args.worlds:
            ranks = run_distributed(measure, world, job(strategy, world))
            r = ranks[0]
            psi, total = r["psi"], r["params"] + r["grads"] + r["optim"]
            formula = FORMULA[strategy](world) * psi
            spec = parse_spec(job(strategy, world))
            planned = estimate(spec, ModelShape.of(spec), strategy, dp=world).state
            rows.append({
                "strategy": strategy, "N": world, "params MB": r["params"] / 2**20,
                "grads MB": r["grads"] / 2**20, "optim MB": r["optim"] / 2**20,
                "total MB": total / 2**20, "formula MB": formula / 2**20,
                "measured/formula": total / formula,
                "planner MB": planned / 2**20, "measured/planner": total / planned,
                "peak RSS MB (max rank)": max(x["peak_rss_mb"] for x in ranks),
            })
            print(rows[-1], flush=True)
    print_table(f"Per-rank memory, fp32 Adam, Psi = {rows[0] and r['psi']:,} parameters (rank 0)", rows)
    within = [abs(r["measured/formula"] - 1) <= 0.10 for r in rows]
    planner_ok = [abs(r["measured/planner"] - 1) <= 0.15 for r in rows]
    print(f"\nwithin 10% of the formula: {sum(within)}/{len(rows)}; within 15% of the planner: "
          f"{sum(planner_ok)}/{len(rows)}")
    write_json("memory", {"psi": r["psi"], "rows": rows, "target": "formula within 10%, planner within 15%"})


if __name__ == "__main__":
    main()
