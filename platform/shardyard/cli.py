"""`shardyard` command line: `shardyard train CONFIG.yaml [--set key=value ...]`."""

from __future__ import annotations

import argparse
import sys

from shardyard.spec import SpecError, load_spec


def add_spec_arguments(parser: argparse.ArgumentParser, config_flag: bool) -> None:
    if config_flag:
        parser.add_argument("--config", required=True, help="YAML job spec")
    else:
        parser.add_argument("config", help="YAML job spec")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key, e.g. --set optim.lr=3e-4 (repeatable)")


def run_train(config: str, overrides: list[str], attach_to_running: bool) -> int:
    """Validate, then train. A bad spec is a message and exit code 2, never a traceback."""
    try:
        spec = load_spec(config, overrides)
        from shardyard.train.launcher import launch  # imports Ray: only once the spec is valid

        launch(spec, attach_to_running=attach_to_running)
    except SpecError as err:
        print(f"shardyard: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardyard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model from a job spec on Ray Train")
    add_spec_arguments(train, config_flag=False)
    args = parser.parse_args(argv)
    if args.command == "train":
        # Local Ray unless RAY_ADDRESS names a cluster.
        return run_train(args.config, args.overrides, attach_to_running=False)
    return 2


if __name__ == "__main__":
    sys.exit(main())
