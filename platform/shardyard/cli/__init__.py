"""`shardyard` command line: one module per verb, each with its help line, its arguments and its
run (which returns an exit code from shardyard/exit_codes.py).

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
import os
import sys
from importlib.metadata import version

from shardyard.cli import export, plan, pool, prepare, schema, serve, train

VERBS = {"train": train, "prepare": prepare, "export": export, "plan": plan, "serve": serve, "pool": pool,
         "schema": schema}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardyard", description=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shardyard {version('shardyard')}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, verb in VERBS.items():
        verb.add_arguments(commands.add_parser(name, help=verb.HELP, description=verb.__doc__,
                                               formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    if os.getcwd() not in sys.path:  # the user's own modules (model.factory) import from where they run, as with python -m
        sys.path.append(os.getcwd())
    return VERBS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
