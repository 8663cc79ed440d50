"""`shardyard train CONFIG.yaml`: validate the job spec, then train it on Ray Train (a local Ray
unless RAY_ADDRESS names a cluster). jobs/train.py, the `ray job submit` entrypoint, runs the same."""

from __future__ import annotations

import argparse
import sys

import yaml

from shardyard import exit_codes
from shardyard.cli.arguments import add_spec_arguments
from shardyard.spec import JobSpec, SpecError, load_spec
from shardyard.train.early_sigterm import StoppedBeforeTraining, sigterm_before_training

HELP = "train a model from a job spec on Ray Train"


def add_train_arguments(parser: argparse.ArgumentParser, config_flag: bool) -> None:
    add_spec_arguments(parser, config_flag)
    parser.add_argument("--take-over", action="store_true",
                        help="train the run even if another launch's lease on it has not expired "
                             "(that launch is gone, on another host)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the spec as it will run (base files merged, overrides and defaults "
                             "applied) as YAML, and train nothing")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser, config_flag=False)


def run(args: argparse.Namespace) -> int:
    return run_train(args.config, args.overrides, attach_to_running=False, take_over=args.take_over,
                     print_config=args.print_config)


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
    from shardyard.train.job import NothingToTrain, train_job
    from shardyard.train.outcomes import Preempted, RunGaveUp

    try:
        train_job(spec, attach_to_running, take_over)
    except NothingToTrain as err:
        print(f"shardyard: {err}", file=sys.stderr)
        return exit_codes.DONE
    except RunGaveUp as err:  # a deterministic error: its message is the first line of the worker's
        print(f"shardyard: {err}", file=sys.stderr)
        return exit_codes.GAVE_UP
    except Preempted as err:
        print(f"shardyard: {err}", file=sys.stderr)
        return exit_codes.INTERRUPTED if err.by == "Ctrl-C" else exit_codes.PREEMPTED
    return exit_codes.DONE
