"""MPS daemons and daemon directories that no journal entry owns (docs/mps.md,
"Lifecycle"), removed by the MPS watch at the plugin's start and with every check
(driver/state/mps_watch.py), under the node lock.

They are what a lost journal entry, a crash between steps another release did not
order as this one does, or a hand-made copy leaves: a daemon Deployment of this node
(labelled `<driverName>/mps-daemon`) or a directory under `<plugin data dir>/mps/`
that no record names, intents included (a prepare journals its intent before it
makes either, under the same lock). Deployments go first, each waited for until its
pod is gone; directories only once every Deployment went, so no daemon still uses
one: whatever runs in a directory's place (the node daemon its pid file names, the
Deployment its name derives to) is stopped, the tmpfs on its `shm/` unmounted, then
the directory removed.

Each removal is counted (`gpu_dra_mps_orphans_removed_total` by kind) and returned,
for a Node Event. One that fails is logged and tried again at the next sweep.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from driver.errors import DriverError
from driver.observability import metrics
from driver.state.journal.checkpoint import ClaimEntry
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemons import MpsDaemons, daemon_dirs
from driver.state.mps.shm import ShmBound

log = logging.getLogger(__name__)

KIND_DEPLOYMENT: Final = "deployment"
KIND_DIRECTORY: Final = "directory"


@dataclass(frozen=True)
class Orphan:
    """One thing removed: its kind (the metric's label) and what it was."""

    kind: str
    what: str


def sweep_orphans(
    root: Path,
    journal: Mapping[str, ClaimEntry],
    kinds: Sequence[MpsDaemons],
    shm: ShmBound | None = None,
) -> list[Orphan]:
    """Remove, with each kind of daemon in `kinds`, this node's daemons and the
    directories under `root` that no record of `journal` names (`shm` unmounts the
    tmpfs on a directory's `shm/` first)."""
    owned = [d.mps for entry in journal.values() for d in entry.devices if d.mps is not None]
    removed: list[Orphan] = []
    settled = True
    for daemons in kinds:
        try:
            leftovers = daemons.leftovers(owned)
        except DriverError as err:
            log.warning("MPS daemons of this node not swept: %s; trying again", err)
            settled = False
            continue
        for leftover in leftovers:
            try:
                what = daemons.remove(leftover)
            except DriverError as err:
                log.warning("removing the MPS daemon %s failed: %s; trying again", leftover, err)
                settled = False
                continue
            removed.append(_removed(KIND_DEPLOYMENT, f"the MPS daemon {what}"))
    if settled:  # else a daemon left may still use a directory
        removed += _sweep_directories(root, {r.directory for r in owned}, kinds, shm)
    return removed


def _sweep_directories(
    root: Path, owned: set[str], kinds: Sequence[MpsDaemons], shm: ShmBound | None
) -> list[Orphan]:
    try:
        found = sorted(p for p in root.iterdir() if p.name not in owned)
    except FileNotFoundError:
        return []
    except OSError as err:
        log.warning("MPS daemon directories not swept: %s", err)
        return []
    removed: list[Orphan] = []
    for path in found:
        if path.is_symlink() or not path.is_dir():
            continue  # not the driver's
        record = MpsRecord("", path.name)
        dirs = daemon_dirs(root, record)
        stopped: list[str] = []
        try:
            for daemons in kinds:
                what = daemons.stop(record, dirs, any_instance=True)
                if what is not None:
                    stopped.append(what)
            if shm is not None and dirs.shm is not None:
                shm.release(dirs.shm)
        except DriverError as err:
            log.warning(
                "stopping the MPS daemon in %s or unmounting its /dev/shm failed: %s; trying again",
                path,
                err,
            )
            continue
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            log.warning("the MPS daemon directory %s could not be removed", path)
            continue
        what = f"the MPS daemon directory {path}"
        if stopped:
            what += f" (its daemon, {', '.join(stopped)}, stopped)"
        removed.append(_removed(KIND_DIRECTORY, what))
    return removed


def _removed(kind: str, what: str) -> Orphan:
    log.warning("removed %s, which no prepared claim owns", what)
    metrics.MPS_ORPHANS_REMOVED.labels(kind=kind).inc()
    return Orphan(kind, what)
