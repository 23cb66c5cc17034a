"""What gpu-dra's subcommands share on their command line: their parsers, the
arguments several take, argument types."""

from __future__ import annotations

import argparse
from typing import Any

from driver.cli.state_dir import add_host_root_argument, add_state_dir_argument
from driver.health.failures import DEFAULT_DRIVER_NAME
from driver.plugin.options.host_inputs import driver_name_argument


def add_command(
    subcommands: Any, name: str, description: str | None, help: str
) -> argparse.ArgumentParser:
    """The parser of subcommand (or action) `name`: `help` in its parent's list,
    `description` (its module's docstring) shown as written."""
    parser: argparse.ArgumentParser = subcommands.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def add_state_arguments(
    parser: argparse.ArgumentParser, driver_help: str = "DRA driver name (default: %(default)s)"
) -> None:
    """`--driver-name`, `--state-dir` and `--host-root`: the plugin data directory of
    the node that a command reads (`driver.cli.state_dir.state_dir_of`)."""
    parser.add_argument(
        "--driver-name", type=driver_name_argument, default=DEFAULT_DRIVER_NAME, help=driver_help
    )
    add_state_dir_argument(parser, default=None)
    add_host_root_argument(parser)


def add_output_argument(parser: argparse.ArgumentParser) -> None:
    """`-o table|json|yaml` (`driver.cli.output.print_report`)."""
    parser.add_argument(
        "-o",
        "--output",
        choices=("table", "json", "yaml"),
        default="table",
        help="output format (default: %(default)s)",
    )


def positive_seconds(text: str) -> float:
    """A timeout in seconds: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
