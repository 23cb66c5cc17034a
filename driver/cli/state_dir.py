"""The plugin data directory the offline commands read (`--state-dir`), and a
read-only view of its health store (`health.json`).

The view never changes the plugin's files: an unreadable file is reported as such
(the plugin keeps every GPU failed while it is, docs/health.md).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from driver.fileio import UnsafeFileError, permission_denied, read_file_nofollow
from driver.health.persistence import HealthRecords, NewerSchemaError, parse_records
from driver.health.store import DEFAULT_DRIVER_NAME, HealthStore

STATE_DIR_ENV = "GPU_DRA_STATE_DIR"
PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
HEALTH_FILE = "health.json"
CORRUPT_CONSEQUENCE = (
    "; the plugin keeps every GPU failed until it is restored or moved aside and the "
    "plugin restarted (docs/health.md)"
)


def default_state_dir(driver_name: str = DEFAULT_DRIVER_NAME) -> Path:
    """$GPU_DRA_STATE_DIR, else the plugin's standard data dir for `driver_name`."""
    return Path(os.environ.get(STATE_DIR_ENV) or PLUGINS_DIR / driver_name)


# Symbolic links one path may pass through under --host-root (Linux's own limit).
MAX_LINKS = 40


def add_host_root_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host-root",
        metavar="DIR",
        help=(
            "where the node's root filesystem is mounted (`kubectl debug node`: /host): "
            "the directories are the node's paths, resolved inside DIR, a symbolic link "
            "on the node (/var/run -> /run) followed within it"
        ),
    )


def node_path(host_root: str | None, path: Path) -> Path:
    """`path` as the node sees it: unchanged without a host root; else under
    `host_root`, each symbolic link followed within it (an absolute target starts
    again at `host_root`, `..` never leaves it). Raises ValueError on a loop."""
    if not host_root:
        return path
    root = Path(host_root)
    pending = list(path.parts[1:] if path.is_absolute() else path.parts)
    resolved: list[str] = []
    links = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        here = root.joinpath(*resolved, part)
        if not here.is_symlink():
            resolved.append(part)
            continue
        links += 1
        if links > MAX_LINKS:
            raise ValueError(f"{path}: more than {MAX_LINKS} symbolic links under {root}")
        target = Path(os.readlink(here))
        if target.is_absolute():
            resolved = []
            pending = [*target.parts[1:], *pending]
        else:
            pending = [*target.parts, *pending]
    return root.joinpath(*resolved)


def state_dir_of(args: argparse.Namespace) -> Path:
    """--state-dir, else the default for --driver-name; on the node under --host-root."""
    path = Path(args.state_dir) if args.state_dir else default_state_dir(args.driver_name)
    return node_path(getattr(args, "host_root", None), path)


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


def read_health(state_dir: Path, driver_name: str = DEFAULT_DRIVER_NAME) -> HealthView:
    """Read `<state_dir>/health.json` without touching it (an unreadable file is
    reported, never moved aside). A data dir without the file has no recorded failure
    (the plugin writes it on the first one)."""
    path = state_dir / HEALTH_FILE
    if not state_dir.is_dir():
        return HealthView(path, unknown=f"no plugin data directory {state_dir}")
    try:
        records = parse_records(read_file_nofollow(path))
    except FileNotFoundError:
        records = HealthRecords()
    except UnsafeFileError as err:
        return HealthView(path, unknown=f"{path} {err.strerror}{CORRUPT_CONSEQUENCE}")
    except PermissionError:
        return HealthView(path, unknown=permission_denied(path))
    except OSError as err:
        return HealthView(path, unknown=f"cannot read {path}: {err.strerror or err}")
    except NewerSchemaError as err:
        return HealthView(
            path,
            unknown=f"{path} was written by a newer release ({err}); the plugin keeps every "
            "GPU failed until the newer release runs again or the file is moved aside and "
            "the plugin restarted (docs/health.md)",
        )
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        return HealthView(
            path,
            unknown=f"{path} is unreadable (not valid health state: {err}){CORRUPT_CONSEQUENCE}",
        )
    return HealthView(path, store=HealthStore(path, driver=driver_name, records=records))
