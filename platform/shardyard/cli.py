"""`shardyard` command line.

    shardyard train CONFIG.yaml [--set key=value ...] [--take-over]
    shardyard prepare DATA_SPEC.yaml [--set key=value ...]
    shardyard export CHECKPOINT_OR_RUN_DIR OUT.safetensors
    shardyard export CHECKPOINT_OR_RUN_DIR --format hf OUT_DIR
    shardyard plan CONFIG.yaml [--gpus N --gpu-memory 80GB --nodes M] [--set key=value ...]
    shardyard serve RUN_OR_CHECKPOINT_OR_MODEL_DIR [--tensor-parallel-size N] [--port 8000] ...
    shardyard pool POOL.yaml [--set key=value ...]
    shardyard schema [--serve]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from importlib.metadata import version

import yaml

from shardyard import exit_codes
from shardyard.serve.app import command as serve_command
from shardyard.spec import JobSpec, SpecError, load_spec
from shardyard.train.early_sigterm import StoppedBeforeTraining, sigterm_before_training


def add_spec_arguments(parser: argparse.ArgumentParser, config_flag: bool, what: str = "YAML job spec",
                       example: str = "optim.lr=3e-4") -> None:
    if config_flag:
        parser.add_argument("--config", required=True, help=what)
    else:
        parser.add_argument("config", help=what)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override one key, e.g. --set {example} (repeatable)")


def add_train_arguments(parser: argparse.ArgumentParser, config_flag: bool) -> None:
    add_spec_arguments(parser, config_flag)
    parser.add_argument("--take-over", action="store_true",
                        help="train the run even if another launch's lease on it has not expired "
                             "(that launch is gone, on another host)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the spec as it will run (base files merged, overrides and defaults "
                             "applied) as YAML, and train nothing")


def run_train(config: str, overrides: list[str], attach_to_running: bool, take_over: bool = False,
              print_config: bool = False) -> int:
    """Validate, then train. A bad spec is a message and exit code 2, never a traceback; every
    outcome has its own exit code (shardyard/exit_codes.py)."""
    with sigterm_before_training():
        try:
            spec = load_spec(config, overrides)
            if print_config:
                print(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False), end="")
                return exit_codes.DONE
            return _train(spec, attach_to_running, take_over)
        except StoppedBeforeTraining:
            print("shardyard: SIGTERM before training began: stopped, nothing to save", file=sys.stderr)
            return exit_codes.PREEMPTED
        except KeyboardInterrupt as err:  # Ctrl-C before training began, or a second one during it
            print(f"shardyard: {err or 'Ctrl-C before training began: stopped, nothing to save'}", file=sys.stderr)
            return exit_codes.INTERRUPTED
        except SpecError as err:
            print(f"shardyard: {err}", file=sys.stderr)
            return exit_codes.REFUSED


def _train(spec: JobSpec, attach_to_running: bool, take_over: bool) -> int:
    from shardyard.checkpoint.record import newest_step
    from shardyard.storage.store import RunStorage

    for key in ("path", "validation_path"):  # said before Ray and torch load; the preflight checks the rest
        path = getattr(spec.data, key)
        if path is not None and "://" not in path and not os.path.exists(path):
            print(f"shardyard: data.{key} {path!r} does not exist", file=sys.stderr)
            return exit_codes.REFUSED
    done = newest_step(RunStorage(spec.run_uri))
    if done >= spec.run.steps:  # nothing to train: no Ray, no summary of 0 steps
        print(f"shardyard: run '{spec.run.name}' is already at step {done} (run.steps={spec.run.steps}): "
              f"nothing to train. Train it longer with --set run.steps={done + spec.run.steps}, or start "
              f"a new run with --set run.name=NAME", file=sys.stderr)
        return exit_codes.DONE
    import ray

    from shardyard.train.console import ray_console
    from shardyard.train.launcher import Preempted, RunGaveUp, launch  # imports Ray: only once the spec is valid

    # Ray forwards lines until this driver leaves it (a controller's traceback as it ends): the
    # console filter stays in front of them until then. A caller already connected (a script, a
    # notebook) stays connected.
    connected_before = ray.is_initialized()
    with ray_console(spec.run_uri, spec.run.name):
        try:
            launch(spec, attach_to_running=attach_to_running, take_over=take_over)
        except RunGaveUp as err:  # a deterministic error: its message is the first line of the worker's
            print(f"shardyard: {err}", file=sys.stderr)
            return exit_codes.GAVE_UP
        except Preempted as err:
            print(f"shardyard: {err}", file=sys.stderr)
            return exit_codes.INTERRUPTED if err.by == "Ctrl-C" else exit_codes.PREEMPTED
        finally:
            if not connected_before:
                ray.shutdown()
    return exit_codes.DONE


def run_export(checkpoint: str, out: str, fmt: str, trust_factory: str | None = None) -> int:
    """Write a checkpoint of any strategy (or a run directory's newest good one) as one
    safetensors file, or, for a Hugging Face model, as a model directory transformers loads. A bad
    checkpoint is named, never loaded; a run directory falls back to its previous good one."""
    from shardyard.checkpoint.layout import read_spec
    from shardyard.checkpoint.loaders import export_safetensors, load_model, servable
    from shardyard.checkpoint.record import BadCheckpoint

    try:
        path = servable(checkpoint)
        if path is None:
            print(f"shardyard: {checkpoint!r} is neither a committed checkpoint nor a run directory with one "
                  f"(`shardyard train` writes them)", file=sys.stderr)
            return 2
        if fmt == "safetensors":
            print(export_safetensors(path, out, trust_factory))
            return 0
        model_name = read_spec(path).model.name
        if model_name != "hf":
            print(f"shardyard: --format hf writes Hugging Face models; {checkpoint!r} holds model.name "
                  f"'{model_name}' (use --format safetensors)", file=sys.stderr)
            return 2
        from shardyard.data.shards import TOKENIZER_DIR
        from shardyard.models.hf import export_hf_directory

        run_tokenizer = path.parent / TOKENIZER_DIR  # the tokenizer the run's prepared data used, if any
        print(export_hf_directory(load_model(path, verify=False), out,
                                  run_tokenizer if run_tokenizer.is_dir() else None))
        return 0
    except (BadCheckpoint, SpecError) as err:
        print(f"shardyard: {err}", file=sys.stderr)
        return 2


def count_from(least: int) -> Callable[[str], int]:
    """argparse's type for a whole number of at least `least`: one below it is refused by
    argparse's usage line, naming the least."""
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{text}: at least {least}")
        return value

    parse.__name__ = "int"  # argparse's "invalid int value" for text that is no number
    return parse


def count(n: float) -> str:
    """A parameter count as people write it: 850K, 12.3M, 7.24B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:g}"


def run_plan(args: argparse.Namespace) -> int:
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
        return 2
    shape = ModelShape.of(spec)
    chosen, plans, reason = recommend(spec, cluster, shape)
    kind = "GPU" if cluster.gpu else "CPU worker"
    print(f"{cluster.devices} {kind}s on {cluster.nodes} node(s), {memory / 2**30:.1f} GiB each; "
          f"model {spec.model.name} ({count(shape.total)} parameters), global batch {spec.batch.global_batch_size}, micro-batch "
          f"{spec.batch.micro_batch_size}\n")
    print(table(plans, chosen, 0.9 * memory))
    print(f"\nrecommended: {reason}")
    print_serving_memory(spec, cluster.gpu)
    return 0 if chosen else 1


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardyard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shardyard {version('shardyard')}")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model from a job spec on Ray Train")
    add_train_arguments(train, config_flag=False)
    prepare = commands.add_parser("prepare", help="raw text (files, JSON Lines, Parquet) to token shards for "
                                                   "data.name 'shards', as a Ray Data job")
    add_spec_arguments(prepare, config_flag=False, what="YAML data spec (source, tokenizer, output)",
                       example="workers=4")
    export = commands.add_parser("export", help="checkpoint -> one safetensors state_dict file, or a "
                                                 "Hugging Face model directory")
    export.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its latest)")
    export.add_argument("out", help="output .safetensors path (--format hf: a directory)")
    export.add_argument("--format", dest="fmt", choices=("safetensors", "hf"), default="safetensors",
                        help="hf: config.json, safetensors weights and tokenizer files, for "
                             "AutoModelForCausalLM.from_pretrained (model.name 'hf' runs)")
    export.add_argument("--trust-factory", metavar="MODULE:FUNCTION",
                        help="a custom model's factory, to import for a checkpoint that names it (a "
                             "factory named by a file in the run directory is never imported unasked)")
    plan = commands.add_parser("plan", help="per-device memory and communication of each parallelism; "
                                             "the recommended one")
    add_spec_arguments(plan, config_flag=False)
    plan.add_argument("--gpus", type=count_from(0), default=0,
                      help="GPUs in the cluster (default: plan for this machine's CPUs at the spec's world size)")
    plan.add_argument("--gpu-memory", default="80GB", help="memory per GPU, e.g. 80GB, 24GiB")
    plan.add_argument("--nodes", type=count_from(1), default=1)
    serve = commands.add_parser("serve", help="serve a run, a checkpoint or a Hugging Face model directory over "
                                               "HTTP (OpenAI API), with vLLM's flag names",
                                description=serve_command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve_command.add_serve_arguments(serve)
    pool = commands.add_parser("pool", help="train an elastic run and serve it from one pool of devices: serving "
                                             "borrows training's workers under load and gives them back")
    add_spec_arguments(pool, config_flag=False, what="YAML pool spec (devices, training job, serving app, policy)",
                       example="policy.cool_down_s=30")
    schema = commands.add_parser("schema", help="the job spec's JSON schema (for editors' completion and checks)")
    schema.add_argument("--serve", action="store_true", help="the serving config's instead")
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path:  # the user's own modules (model.factory) import from where they run, as with python -m
        sys.path.append(os.getcwd())
    if args.command == "schema":
        from shardyard.serve.config import ServeConfig
        from shardyard.spec import JobSpec

        print(json.dumps((ServeConfig if args.serve else JobSpec).model_json_schema(), indent=2))
        return 0
    if args.command == "serve":
        return serve_command.run_serve(args)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "prepare":
        from shardyard.data.prepare import main as run_prepare  # imports Ray Data: only when asked for

        return run_prepare(args.config, args.overrides)
    if args.command == "pool":
        from shardyard.pool.command import run_pool  # imports Ray and Serve: only when asked for

        return run_pool(args.config, args.overrides)
    if args.command == "export":
        return run_export(args.checkpoint, args.out, args.fmt, args.trust_factory)
    # Local Ray unless RAY_ADDRESS names a cluster.
    return run_train(args.config, args.overrides, attach_to_running=False, take_over=args.take_over,
                     print_config=args.print_config)


if __name__ == "__main__":
    sys.exit(main())
