"""`shardyard train CONFIG.yaml`: validate the job spec, then train it on Ray Train (a local Ray
unless RAY_ADDRESS names a cluster). jobs/train.py, the `ray job submit` entrypoint, runs the same."""

from __future__ import annotations

import argparse
import os
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
    from shardyard.train.launcher import launch  # imports Ray: only once the spec is valid
    from shardyard.train.outcomes import Preempted, RunGaveUp

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
