"""`gpu-dra`: the operator CLI. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from driver.cli import inventory, mock, status
from driver.cli.health import health_show
from driver.cli.journal import journal_show
from driver.cli.validate import validate_command
from driver.cli.verbosity import add_verbosity_flag, configure_logging
from driver.fileio import permission_denied
from driver.plugin.options.flags import add_version_flag

SIGPIPE_EXIT = 128 + signal.SIGPIPE  # what a shell reports for a command SIGPIPE killed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-dra", description=__doc__)
    add_version_flag(parser)
    subcommands = parser.add_subparsers(dest="command", required=True)
    for module in (inventory, validate_command, health_show, status, journal_show, mock):
        module.add_parser(subcommands)
    add_verbosity_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbosity)
    try:
        exit_code: int = args.run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        return reader_went_away()
    except PermissionError as err:  # the plugin's files are root's (mode 0700)
        command = " ".join(
            filter(None, (args.command, getattr(args, f"{args.command}_action", None)))
        )
        print(f"gpu-dra {command}: {permission_denied(err.filename)}", file=sys.stderr)
        return 1
    return exit_code


def reader_went_away() -> int:
    """The reader of stdout closed it (`gpu-dra inventory | head`): stop quietly, as a
    command killed by SIGPIPE does. stdout goes to /dev/null so that the interpreter's
    final flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
