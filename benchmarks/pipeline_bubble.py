"""Pipeline bubble: measured idle fraction per stage for GPipe and 1F1B, p = 2 and 4 stages,
m = 1, 2, 4, 8, 16 micro-batches, beside the theoretical (p-1)/(m+p-1); and each schedule's peak
activation memory (1F1B should hold fewer micro-batches' activations than GPipe).

The stages are real `torch.distributed.pipelining` stages over gloo whose compute is a fixed
sleep (forward t, backward 2t) inside an autograd function: like a GPU kernel, it occupies its
rank without taking a CPU core, so the schedule is measured rather than this machine's 2 cores.
Busy time is recorded inside that function; idle = 1 - busy / step wall time. Activation memory
is the peak of bytes saved for backward and not yet released.

    python benchmarks/pipeline_bubble.py [--forward-ms 10]
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (puts the package on sys.path)
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from common import print_table, write_json
from shardyard.localdist import run_distributed
from shardyard.parallel.pipeline import SCHEDULES

HIDDEN, MICRO_BATCH, STEPS = 256, 4, 3


class Meter:
    busy = 0.0
    live_bytes = 0
    peak_bytes = 0


class TimedCompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, seconds: float) -> torch.Tensor:
        start = time.perf_counter()
        time.sleep(seconds)
        ctx.save_for_backward(x, weight)
        ctx.seconds = seconds
        Meter.live_bytes += x.nbytes
        Meter.peak_bytes = max(Meter.peak_bytes, Meter.live_bytes)
        Meter.busy += time.perf_counter() - start
        return x * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = time.perf_counter()
        x, weight = ctx.saved_tensors
        time.sleep(2 * ctx.seconds)
        Meter.live_bytes -= x.nbytes
        Meter.busy += time.perf_counter() - start
        return grad * weight, (grad * x).sum(0), None


class SleepStage(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TimedCompute.apply(x, self.weight, self.seconds)


def run_stage(rank: int, world: int, schedule_name: str, m: int, seconds: float) -> dict:
    stage = PipelineStage(SleepStage(seconds), rank, world, torch.device("cpu"))
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=m, loss_fn=lambda out, tgt: out.sum())
    inputs = torch.randn(m * MICRO_BATCH, HIDDEN)
    fractions, peaks = [], []
    for step in range(STEPS):
        dist.barrier()
        Meter.busy, Meter.live_bytes, Meter.peak_bytes = 0.0, 0, 0  # nothing is live between steps
        start = time.perf_counter()
        if rank == 0:
            schedule.step(inputs)
        elif rank == world - 1:
            schedule.step(target=inputs, losses=[])
        else:
            schedule.step()
        wall = time.perf_counter() - start
        if step > 0:  # the first step also infers shapes and warms up gloo
            fractions.append(1 - Meter.busy / wall)
            peaks.append(Meter.peak_bytes)
    return {"idle": sum(fractions) / len(fractions), "peak_activation_bytes": max(peaks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    rows = []
    per_mb = MICRO_BATCH * HIDDEN * 4
    for p in args.stages:
        for m in args.microbatches:
            row = {"p": p, "m": m, "theory idle": (p - 1) / (m + p - 1)}
            for name in ("gpipe", "1f1b"):
                if name == "1f1b" and m < p:  # 1F1B needs at least one micro-batch per stage
                    row.update({f"{name} idle (mean)": None, f"{name} idle (max stage)": None,
                                f"{name} peak act (micro-batches)": None})
                    continue
                ranks = run_distributed(run_stage, p, name, m, args.forward_ms / 1000)
                idle = [r["idle"] for r in ranks]
                row[f"{name} idle (mean)"] = sum(idle) / p
                row[f"{name} idle (max stage)"] = max(idle)
                row[f"{name} peak act (micro-batches)"] = max(r["peak_activation_bytes"] for r in ranks) / per_mb
            for name in ("gpipe", "1f1b"):
                idle = row[f"{name} idle (mean)"]
                row[f"{name} - theory (pp)"] = None if idle is None else 100 * (idle - row["theory idle"])
            rows.append(row)
            print(row, flush=True)
    print_table(f"Pipeline bubble: stage forward {args.forward_ms} ms, backward 2x; activations "
                f"in units of one micro-batch", rows)
    gaps = [abs(r[k]) for r in rows for k in ("gpipe - theory (pp)", "1f1b - theory (pp)") if r[k] is not None]
    deeper = [r for r in rows if r["m"] > r["p"]]
    lower = sum(r["1f1b peak act (micro-batches)"] < r["gpipe peak act (micro-batches)"] for r in deeper)
    print(f"\nwithin 10 points of theory: {sum(g <= 10 for g in gaps)}/{len(gaps)}; 1F1B peak "
          f"activations below GPipe's where m > p: {lower}/{len(deeper)}")
    write_json("pipeline_bubble", {"forward_ms": args.forward_ms, "rows": rows})


if __name__ == "__main__":
    main()
