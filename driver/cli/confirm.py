"""Confirmation before a command changes the node: `--yes`, or a `y` typed at a
terminal. Without a terminal and without `--yes` the command refuses (a script must
say what it wants)."""

from __future__ import annotations

import argparse
from typing import TextIO


class NotConfirmed(Exception):
    """The operator did not confirm; the message says why."""


def add_yes_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-y",
        "--yes",
        action="store_true",
        help="do it without asking (required when stdin is not a terminal)",
    )


def confirm(question: str, *, yes: bool, stdin: TextIO, out: TextIO) -> None:
    """Return when confirmed; raise NotConfirmed otherwise."""
    if yes:
        return
    if not stdin.isatty():
        raise NotConfirmed("stdin is not a terminal: refusing without --yes")
    out.write(f"{question} [y/N] ")
    out.flush()
    answer = stdin.readline().strip().lower()
    if answer not in ("y", "yes"):
        raise NotConfirmed("not confirmed: nothing changed")
