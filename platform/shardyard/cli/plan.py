"""`shardyard plan CONFIG.yaml`: each parallelism's memory and communication per device on the
devices named (or this machine's CPUs), and the one recommended."""

from __future__ import annotations

import argparse
import os
import sys

from shardyard import exit_codes
from shardyard.cli.arguments import add_spec_arguments, count_from
from shardyard.spec import JobSpec, SpecError, load_spec

HELP = "per-device memory and communication of each parallelism; the recommended one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser, config_flag=False)
    parser.add_argument("--gpus", type=count_from(0), default=0,
                        help="GPUs in the cluster (default: plan for this machine's CPUs at the spec's world size)")
    parser.add_argument("--gpu-memory", default="80GB", help="memory per GPU, e.g. 80GB, 24GiB")
    parser.add_argument("--nodes", type=count_from(1), default=1)


def count(n: float) -> str:
    """A parameter count as people write it: 850K, 12.3M, 7.24B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def run(args: argparse.Namespace) -> int:
    """Print every plan's memory and communication, and the recommended one with its reason."""
    import psutil

    from shardyard.planner import Cluster, ModelShape, parse_bytes, recommend, table

    try:
        spec = load_spec(args.config, args.overrides)
        if args.gpus:
            memory = parse_bytes(args.gpu_memory)
            cluster = Cluster(args.gpus, memory, args.nodes, gpu=True, cpu_cores=os.cpu_count() or 1)
        else:  # this machine's CPUs: the spec's largest world size shares its memory
            workers = spec.scaling.max_workers or spec.scaling.num_workers or 1
            memory = psutil.virtual_memory().total / workers
            cluster = Cluster(workers, memory, args.nodes, gpu=False, cpu_cores=os.cpu_count() or 1)
    except (SpecError, ValueError) as err:
        print(f"shardyard: {err}", file=sys.stderr)
        return exit_codes.REFUSED
    shape = ModelShape.of(spec)
    chosen, plans, reason = recommend(spec, cluster, shape)
    kind = "GPU" if cluster.gpu else "CPU worker"
    print(f"{cluster.devices} {kind}s on {cluster.nodes} node(s), {memory / 2**30:.1f} GiB each; "
          f"model {spec.model.name} ({count(shape.total)} parameters), global batch {spec.batch.global_batch_size}, micro-batch "
          f"{spec.batch.micro_batch_size}\n")
    print(table(plans, chosen, 0.9 * memory))
    print(f"\nrecommended: {reason}")
    print_serving_memory(spec, cluster.gpu)
    return exit_codes.DONE if chosen else exit_codes.NOTHING_FITS


def print_serving_memory(spec: JobSpec, gpu: bool) -> None:
    """What one replica serving the trained model takes at the serving defaults, in the dtype
    `auto` serves it in on these devices (bfloat16 on GPUs, float32 on CPUs)."""
    import torch

    from shardyard.checkpoint.layout import serving_context
    from shardyard.planner import serving_memory
    from shardyard.serve.config import BatchingSettings, EngineSettings

    running = BatchingSettings.model_fields["max_batch_size"].default
    context = serving_context(spec.model) if hasattr(spec.model, "block_size") else 0
    memory = serving_memory(spec.model, torch.bfloat16 if gpu else torch.float32, running * context, running, gpu,
                            EngineSettings().paged_attention(gpu))
    if memory is not None:
        print(f"serving it (one replica at the defaults: {running} requests at once, a KV cache of "
              f"{running} contexts of {context} tokens): {memory}")
