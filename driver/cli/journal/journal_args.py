"""What `gpu-dra journal show` and `quarantine` share: their arguments (driver name,
the plugin's data directory, the CDI spec directory, the node's root where it is
mounted elsewhere) and the claims' CDI specs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from driver.cdi.claim_specs import CdiSpecs
from driver.cli.arguments import add_state_arguments
from driver.cli.state_dir import node_path, state_dir_of


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    add_state_arguments(parser)
    parser.add_argument(
        "--cdi-root",
        default=os.environ.get("CDI_ROOT") or "/var/run/cdi",
        help="CDI spec directory, to check each claim's spec ($CDI_ROOT; default %(default)s)",
    )


def cdi_root_of(args: argparse.Namespace) -> Path:
    """--cdi-root; on the node under --host-root."""
    return node_path(args.host_root, Path(args.cdi_root))


__all__ = ["add_common_arguments", "cdi_root_of", "cdi_specs", "state_dir_of"]


def cdi_specs(cdi_root: Path, driver: str) -> CdiSpecs | None:
    """The claims' CDI specs, None when there is no such directory to check."""
    return CdiSpecs(cdi_root, driver) if cdi_root.is_dir() else None
