"""`gpu-dra`: the operator CLI. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from driver.cli import health, inventory, journal, mock, validate
from driver.cli.verbosity import add_verbosity_flag, configure_logging
from driver.plugin.flags import add_version_flag


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-dra", description=__doc__)
    add_version_flag(parser)
    subcommands = parser.add_subparsers(dest="command", required=True)
    for module in (inventory, validate, health, journal, mock):
        module.add_parser(subcommands)
    add_verbosity_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbosity)
    exit_code: int = args.run(args)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
