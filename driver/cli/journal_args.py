"""What `gpu-dra journal show` and `quarantine` share: their arguments (driver name,
the plugin's data directory, the CDI spec directory) and the claims' CDI specs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from driver.cli.state_dir import add_state_dir_argument, default_state_dir
from driver.health.failures import DEFAULT_DRIVER_NAME
from driver.plugin.host_inputs import driver_name_argument
from driver.state.cdi import CdiSpecs


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--driver-name",
        type=driver_name_argument,
        default=DEFAULT_DRIVER_NAME,
        help="DRA driver name (default: %(default)s)",
    )
    add_state_dir_argument(parser, default=None)
    parser.add_argument(
        "--cdi-root",
        default=os.environ.get("CDI_ROOT") or "/var/run/cdi",
        help="CDI spec directory, to check each claim's spec ($CDI_ROOT; default %(default)s)",
    )


def state_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.state_dir) if args.state_dir else default_state_dir(args.driver_name)


def cdi_specs(cdi_root: Path, driver: str) -> CdiSpecs | None:
    """The claims' CDI specs, None when there is no such directory to check."""
    return CdiSpecs(cdi_root, driver) if cdi_root.is_dir() else None
