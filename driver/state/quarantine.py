"""Moving a corrupt journal aside, and what becomes of the MIG devices it owned.

`quarantine_checkpoint` renames a corrupt `checkpoint.json` to
`checkpoint.json.corrupt-<UTC time>` (kept for inspection) so the plugin prepares
again from a new journal. The MIG devices the driver created for claims of the old
journal are then nobody's, unless the operator says otherwise (`OwnedMig`):

- `foreign` (nothing carried over): they are treated as an administrator's. Under
  `--mig-strategy auto` their GPU turns static and publishes them, so the scheduler
  may hand a device a running pod still uses to a new claim; under `dynamic` the
  plugin refuses to start until they are destroyed (`nvidia-smi mig -dci/-dgi`).
- `adopt`: the readable entries that own MIG devices are carried into the new
  journal as they were: their claims keep their devices and the driver's protection,
  and their unprepare destroys them.
- `destroy`: those entries are carried into the new journal as half-done prepares:
  the plugin's next start rolls them back, destroying each MIG device by its recorded
  ids (only if the instance under an id still has the recorded profile and placement)
  and removing the claim's CDI spec. Pods using them lose their devices.

Entries are read from the corrupt file without verifying its checksum
(`salvage_entries`), as `gpu-dra journal show` lists them: the operator chooses after
reading them. A file that does not parse carries nothing over.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from driver.state.checkpoint import (
    CHECKPOINT_FILE,
    CORRUPT_SUFFIX,
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
)
from driver.state.fileio import fsync_dir, read_file_nofollow
from driver.state.locking import SerializeLock


class OwnedMig(enum.Enum):
    """What becomes of the MIG devices a quarantined journal's claims own."""

    FOREIGN = "foreign"
    ADOPT = "adopt"
    DESTROY = "destroy"


def salvage_entries(path: Path) -> dict[str, ClaimEntry]:
    """The entries of a corrupt journal that still parse (checksum not verified); no
    symlink followed, no FIFO waited on."""
    try:
        doc = json.loads(read_file_nofollow(path))
    except (OSError, ValueError, RecursionError):
        return {}
    raw = doc.get("entries") if isinstance(doc, dict) else None
    if not isinstance(raw, dict):
        return {}
    entries: dict[str, ClaimEntry] = {}
    for uid, entry in raw.items():
        with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
            entries[str(uid)] = ClaimEntry.from_json(entry)
    return entries


def owning_mig(entries: dict[str, ClaimEntry]) -> dict[str, ClaimEntry]:
    """The entries that own a MIG device (one the driver created for the claim)."""
    return {
        uid: entry
        for uid, entry in entries.items()
        if any(d.mig is not None and d.mig.owned for d in entry.devices)
    }


def carried_entries(entries: dict[str, ClaimEntry], owned_mig: OwnedMig) -> dict[str, ClaimEntry]:
    """What the new journal starts with for `owned_mig` (see the module doc)."""
    owning = owning_mig(entries)
    if owned_mig is OwnedMig.ADOPT:
        return owning
    if owned_mig is OwnedMig.DESTROY:
        return {
            uid: replace(entry, state=ClaimState.PREPARE_STARTED, unpreparing=None)
            for uid, entry in owning.items()
        }
    return {}


def quarantine_checkpoint(
    data_dir: Path | str,
    *,
    force: bool = False,
    now: datetime | None = None,
    owned_mig: OwnedMig = OwnedMig.FOREIGN,
) -> Path | None:
    """Operator action: move a corrupt checkpoint aside so the driver prepares again.
    Renames it to `checkpoint.json.corrupt-<UTC timestamp>` and returns the new path;
    None if there is no checkpoint. With `owned_mig` adopt or destroy, the new journal
    is written with the entries `carried_entries` gives; otherwise there is none.

    Refuses (ValueError) to move a checkpoint that is valid unless `force` is set.
    Takes the serialize lock, so it is safe while a plugin is running.
    """
    cp = Checkpoint(data_dir)
    with SerializeLock(cp.data_dir).hold():
        if not os.path.lexists(cp.path):  # a symlink, even a dangling one, is moved aside
            return None
        if not force:
            try:
                cp.load()
            except CheckpointCorruptError:
                pass
            else:
                raise ValueError(f"checkpoint {cp.path} is valid; not moving it (use force)")
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S.%fZ")
        target = cp.path.with_name(f"{CHECKPOINT_FILE}{CORRUPT_SUFFIX}{stamp}")
        os.rename(cp.path, target)
        fsync_dir(cp.data_dir)
        carried = carried_entries(salvage_entries(target), owned_mig)
        if carried:
            cp.store(carried)
        return target
