"""`shardyard schema [--serve]`: the job spec's (or the serving config's) JSON schema, for editors'
completion and checks."""

from __future__ import annotations

import argparse
import json

from shardyard import exit_codes

HELP = "the job spec's JSON schema (for editors' completion and checks)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--serve", action="store_true", help="the serving config's instead")


def run(args: argparse.Namespace) -> int:
    from shardyard.serve.config import ServeConfig
    from shardyard.spec import JobSpec

    print(json.dumps((ServeConfig if args.serve else JobSpec).model_json_schema(), indent=2))
    return exit_codes.DONE
