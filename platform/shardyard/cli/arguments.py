"""Arguments more than one verb takes."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_spec_arguments(parser: argparse.ArgumentParser, config_flag: bool, what: str = "YAML job spec",
                       example: str = "optim.lr=3e-4") -> None:
    if config_flag:
        parser.add_argument("--config", required=True, help=what)
    else:
        parser.add_argument("config", help=what)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override one key, e.g. --set {example} (repeatable)")


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
