"""`shardyard prepare DATA_SPEC.yaml`: raw text to token shards, as a Ray Data job."""

from __future__ import annotations

import argparse
import os
import sys

from shardyard import exit_codes
from shardyard.cli.arguments import add_spec_arguments
from shardyard.spec import SpecError

HELP = "raw text (files, JSON Lines, Parquet) to token shards for data.name 'shards', as a Ray Data job"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser, config_flag=False, what="YAML data spec (source, tokenizer, output)", example="workers=4")


def run(args: argparse.Namespace) -> int:
    # Ray Data's usage telemetry starts a thread that polls the cluster every 10 s for as long as
    # the process lives. A poll that falls during Ray's shutdown at interpreter exit makes Ray's
    # core worker end the process with status 1 ("The core worker has already been shutdown"):
    # a finished `prepare` reported as failed (seen in CI, more often on a loaded machine). This
    # is Ray Data's own opt-out of that telemetry, for this process only.
    os.environ.setdefault("RAY_DATA_USAGE_DISABLED", "1")
    from shardyard.data.prepare import PrepareError, load_prepare_spec, prepare  # imports Ray Data: only when asked for

    try:
        prepare(load_prepare_spec(args.config, args.overrides))
    except (SpecError, PrepareError) as err:
        print(f"shardyard prepare: {err}", file=sys.stderr)
        return exit_codes.REFUSED
    return exit_codes.DONE
