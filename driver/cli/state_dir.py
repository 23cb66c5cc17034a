"""The plugin data directory the offline commands read (`--state-dir`), and a
read-only view of its health store (`health.json`).

The view never changes the plugin's files: `HealthStore` moves an unreadable file
aside when it loads one, so the CLI loads a private copy and reports the file as
unreadable instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from driver.health.store import DEFAULT_DRIVER_NAME, HealthStore
from driver.state.cdi import UnsafeFileError, read_file_nofollow

STATE_DIR_ENV = "GPU_DRA_STATE_DIR"
PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
HEALTH_FILE = "health.json"


def default_state_dir(driver_name: str = DEFAULT_DRIVER_NAME) -> Path:
    """$GPU_DRA_STATE_DIR, else the plugin's standard data dir for `driver_name`."""
    return Path(os.environ.get(STATE_DIR_ENV) or PLUGINS_DIR / driver_name)


def add_state_dir_argument(parser: argparse.ArgumentParser, *, default: str | None) -> None:
    parser.add_argument(
        "--state-dir",
        default=default,
        metavar="DIR",
        help=(
            "the plugin's data directory on this node (env "
            f"{STATE_DIR_ENV}; default: {PLUGINS_DIR}/<driver name>)"
        ),
    )


@dataclass
class HealthView:
    """The failures recorded in a plugin's data dir, or why they are unknown."""

    path: Path
    store: HealthStore | None = None
    unknown: str | None = None  # why health is unknown (store is None then)
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def read_health(state_dir: Path, driver_name: str = DEFAULT_DRIVER_NAME) -> HealthView:
    """Read `<state_dir>/health.json` without touching it. A data dir without the file
    has no recorded failure (the plugin writes it on the first one)."""
    path = state_dir / HEALTH_FILE
    if not state_dir.is_dir():
        return HealthView(path, unknown=f"no plugin data directory {state_dir}")
    try:
        data = read_file_nofollow(path)
    except FileNotFoundError:
        data = None
    except (UnsafeFileError, OSError) as err:
        return HealthView(path, unknown=f"cannot read {path}: {err.strerror or err}")
    tmp = tempfile.TemporaryDirectory(prefix="gpu-dra-health-")
    copy = Path(tmp.name) / HEALTH_FILE
    if data is not None:
        copy.write_bytes(data)
    quiet = logging.getLogger("driver.health.store")  # its messages name the private copy
    was_disabled, quiet.disabled = quiet.disabled, True
    try:
        store = HealthStore(copy, driver=driver_name)
    finally:
        quiet.disabled = was_disabled
    if data is not None and not copy.exists():  # the store set an unreadable file aside
        tmp.cleanup()
        return HealthView(path, unknown=f"{path} is unreadable (not valid health state)")
    return HealthView(path, store=store, _tmp=tmp)
