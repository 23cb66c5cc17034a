"""`-v`/`--v` on gpu-dra and every subcommand, on the verbosity scale of all three
binaries (`driver.observability.logs`); the CLI's default is 0, warnings only."""

from __future__ import annotations

import argparse
import logging

from driver.observability.logs import VERBOSITY_HELP, apply_verbosity, stderr_handler
from driver.plugin.options.flags import non_negative_int

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
HELP = f"{VERBOSITY_HELP} (default: 0)"


def add_verbosity_flag(parser: argparse.ArgumentParser) -> None:
    """`-v N` before the subcommand, and after it on every (nested) subcommand."""
    parser.add_argument(
        "-v", "--v", dest="verbosity", type=non_negative_int("-v"), default=0, help=HELP
    )
    for sub in _subparsers(parser):
        # SUPPRESS: a subcommand without -v keeps what was given before it.
        sub.add_argument(
            "-v",
            "--v",
            dest="verbosity",
            type=non_negative_int("-v"),
            default=argparse.SUPPRESS,
            help=HELP,
        )


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found: list[argparse.ArgumentParser] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.append(sub)
                found.extend(_subparsers(sub))
    return found


def configure_logging(verbosity: int) -> None:
    """Log records to stderr at the level `verbosity` asks for; stdout stays the
    command's output."""
    logging.basicConfig(handlers=[stderr_handler(LOG_FORMAT)])
    apply_verbosity(verbosity)
