"""Throughput of every strategy on the same model, data, global batch and world size, as a table
with DDP as 1.00x. Runs on plain torch.distributed (gloo) ranks, so the numbers are the
strategies' own cost, not Ray's start-up.

    python benchmarks/throughput.py [--model gpt|llama] [--world 2] [--steps 12]

`--model llama` trains jobs/configs/llama_fsdp.yaml's Llama (transformers' LlamaForCausalLM), its
pipeline stages split by its own `base_model_pp_plan` and tensor parallelism by its
`base_model_tp_plan`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (puts the package on sys.path)
import torch

from common import print_table, write_json
from shardyard.layout.world_size import grad_accum_steps
from shardyard.data import GlobalSampleOrder, build_dataset, micro_batch_ids
from shardyard.localdist import run_distributed
from shardyard.models import build_model
from shardyard.parallel import build_engine
from shardyard.spec import load_spec
from ddp_overhead import CONFIG, REPO

MODELS = {"gpt": CONFIG, "llama": REPO / "jobs" / "configs" / "llama_fsdp.yaml"}

STRATEGIES = {
    "ddp": {"parallelism.strategy": "ddp"},
    "fsdp": {"parallelism.strategy": "fsdp"},
    "zero1": {"parallelism.strategy": "zero1"},
    "zero2": {"parallelism.strategy": "zero2"},
    "zero3": {"parallelism.strategy": "zero3"},
    "pipeline 1f1b": {"parallelism.strategy": "pipeline", "parallelism.pp": "WORLD",
                      "model.tie_weights": "false"},
    "tensor": {"parallelism.strategy": "tensor", "parallelism.tp": "WORLD"},
}


def time_steps(rank: int, world: int, config: str, overrides: list[str], steps: int) -> list[float]:
    spec = load_spec(config, overrides)
    torch.manual_seed(0)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    dataset = build_dataset(spec)
    order = GlobalSampleOrder(len(dataset), 0)
    accum = grad_accum_steps(spec, world)
    times = []
    for step in range(steps):
        ids = micro_batch_ids(order, step * spec.batch.global_batch_size, engine.dp_rank,
                              engine.dp_size, spec.batch.micro_batch_size, accum)
        batch = [dataset.batch(i) for i in ids]
        start = time.perf_counter()
        engine.train_step(batch)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=list(MODELS), default="gpt")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    config = str(MODELS[args.model])
    rows = []
    for name, settings in STRATEGIES.items():
        if args.model != "gpt":  # the GPT's own keys (its head is tied by default; the Llama's is not)
            settings = {k: v for k, v in settings.items() if not k.startswith("model.")}
        overrides = [f"{k}={str(args.world) if v == 'WORLD' else v}" for k, v in settings.items()]
        # The same work for every strategy: no recomputation (llama_fsdp.yaml turns it on for FSDP).
        overrides += [f"scaling.num_workers={args.world}", "data.max_bytes=400000",
                      "parallelism.activation_checkpointing=false"]
        times = run_distributed(time_steps, args.world, config, overrides, args.steps)
        # Median over ranks' slowest step-by-step time, after the first few (warm-up) steps.
        step_time = statistics.median(max(ts) for ts in zip(*(t[3:] for t in times)))
        spec = load_spec(config, overrides)
        global_batch = spec.batch.global_batch_size
        rows.append({"strategy": name, "samples/s": global_batch / step_time,
                     "tokens/s": global_batch * spec.model.block_size / step_time, "step ms": 1000 * step_time})
        print(rows[-1], flush=True)
    base = rows[0]["samples/s"]
    for row in rows:
        row["vs DDP"] = row["samples/s"] / base
    print_table(f"Throughput, {args.model} ({config}), {args.world} ranks (gloo, CPU), DDP = 1.00x", rows)
    write_json("throughput" if args.model == "gpt" else f"throughput_{args.model}",
               {"model": args.model, "config": str(Path(config).relative_to(REPO)), "world": args.world,
                "rows": rows})


if __name__ == "__main__":
    main()
