"""`-v`/`--v` on gpu-dra and every subcommand, as Kubernetes components spell it."""

from __future__ import annotations

import argparse
import logging

from driver.plugin.flags import non_negative_int

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
# The Kubernetes client logs request headers (bearer tokens) at DEBUG.
QUIET_LOGGERS = ("urllib3", "kubernetes")
DEBUG_VERBOSITY = 4
HELP = "log verbosity: 0 warnings only, 1-3 also info, >= 4 debug (default: 0)"


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


def log_level(verbosity: int) -> int:
    if verbosity >= DEBUG_VERBOSITY:
        return logging.DEBUG
    return logging.INFO if verbosity >= 1 else logging.WARNING


def configure_logging(verbosity: int) -> None:
    """Log records to stderr at the level `verbosity` asks for; stdout stays the
    command's output."""
    logging.basicConfig(format=LOG_FORMAT)
    logging.getLogger().setLevel(log_level(verbosity))
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
