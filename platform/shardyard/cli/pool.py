"""`shardyard pool POOL.yaml`: train an elastic run and serve it from one pool of devices."""

from __future__ import annotations

import argparse

from shardyard.cli.arguments import add_spec_arguments

HELP = ("train an elastic run and serve it from one pool of devices: serving borrows training's workers "
        "under load and gives them back")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser, config_flag=False, what="YAML pool spec (devices, training job, serving app, policy)",
                       example="policy.cool_down_s=30")


def run(args: argparse.Namespace) -> int:
    from shardyard.pool.command import run_pool  # imports Ray and Serve: only when asked for

    return run_pool(args.config, args.overrides)
