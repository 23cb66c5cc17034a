"""Moving a corrupt journal aside, and what becomes of the MIG devices it owned.

`quarantine_checkpoint` renames a corrupt journal, `checkpoint.json` and
`checkpoint.log`, to `checkpoint.json.corrupt-<UTC time>` and
`checkpoint.log.corrupt-<UTC time>` (kept for inspection) so the plugin prepares
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

Entries are read from the corrupt files without verifying checksums
(`salvage_entries`), as `gpu-dra journal show` lists them: the operator chooses after
reading them. A snapshot that does not parse carries over only what its log's lines
that parse set.
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
    SCHEMA_VERSION,
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
)
from driver.state.fileio import fsync_dir, read_file_nofollow
from driver.state.journal_log import LOG_FILE
from driver.state.locking import SerializeLock


class OwnedMig(enum.Enum):
    """What becomes of the MIG devices a quarantined journal's claims own."""

    FOREIGN = "foreign"
    ADOPT = "adopt"
    DESTROY = "destroy"


def salvage_entries(path: Path) -> dict[str, ClaimEntry]:
    """The entries of a corrupt journal that still parse (checksums not verified): the
    snapshot at `path`, then the lines of its log (`checkpoint.log` beside
    `checkpoint.json`, or the log moved aside with the snapshot) unless the snapshot
    says schemaVersion 1. No symlink followed, no FIFO waited on."""
    doc = _parsed(path)
    raw = doc.get("entries") if isinstance(doc, dict) else None
    entries: dict[str, ClaimEntry] = {}
    for uid, entry in raw.items() if isinstance(raw, dict) else ():
        _salvage(entries, uid, entry)
    if isinstance(doc, dict) and doc.get("schemaVersion") == SCHEMA_VERSION:
        return entries  # a log beside it is stale
    try:
        lines = read_file_nofollow(_log_of(path)).splitlines()
    except OSError:
        return entries
    for line in lines:
        record = _parsed_line(line)
        changed, deleted = record.get("set"), record.get("delete")
        for uid, entry in changed.items() if isinstance(changed, dict) else ():
            _salvage(entries, uid, entry)
        for uid in deleted if isinstance(deleted, list) else ():
            entries.pop(str(uid), None)
    return entries


def _parsed(path: Path) -> object:
    try:
        return json.loads(read_file_nofollow(path))
    except (OSError, ValueError, RecursionError):
        return None


def _parsed_line(line: bytes) -> dict[str, object]:
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _salvage(entries: dict[str, ClaimEntry], uid: object, entry: object) -> None:
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        entries[str(uid)] = ClaimEntry.from_json(entry)


def _log_of(snapshot: Path) -> Path:
    """The log of a snapshot: `checkpoint.log<suffix>` beside `checkpoint.json<suffix>`."""
    suffix = snapshot.name.removeprefix(CHECKPOINT_FILE)
    return snapshot.with_name(LOG_FILE + suffix)


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


def carried_fate(entry: ClaimEntry, owned_mig: OwnedMig, spec_in_place: bool) -> str:
    """What the plugin's next start does with an entry that owns MIG devices, after a
    quarantine with `owned_mig` (`carried_entries`); for a half-done prepare whose CDI
    spec is in place, that the corruption may have taken its completion record."""
    fate = _fate(entry, owned_mig)
    if entry.state is ClaimState.PREPARE_STARTED and spec_in_place:
        fate += (
            "; its CDI spec is in place: the prepare may have completed (its completion "
            "record unreadable) and a pod may be using the device"
        )
    return fate


def _fate(entry: ClaimEntry, owned_mig: OwnedMig) -> str:
    if owned_mig is OwnedMig.FOREIGN:
        return "not carried: its MIG devices become foreign (an administrator's)"
    if owned_mig is OwnedMig.DESTROY:
        return (
            "carried as a half-done prepare: its MIG devices are destroyed and its CDI spec "
            "removed at the next start"
        )
    if entry.state is ClaimState.PREPARE_STARTED:
        return (
            "carried as it is, a half-done prepare: rolled back at the next start (the MIG "
            "device its attempt created destroyed, its CDI spec removed)"
        )
    return "carried as prepared: it keeps its MIG devices; its unprepare destroys them"


def quarantine_checkpoint(
    data_dir: Path | str,
    *,
    force: bool = False,
    now: datetime | None = None,
    owned_mig: OwnedMig = OwnedMig.FOREIGN,
) -> Path | None:
    """Operator action: move a corrupt journal aside so the driver prepares again.
    Renames `checkpoint.json` to `checkpoint.json.corrupt-<UTC timestamp>` (returned)
    and `checkpoint.log`, if any, to `checkpoint.log.corrupt-<UTC timestamp>`; None if
    there is no checkpoint.json. With `owned_mig` adopt or destroy, the new journal
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
        # The log first: a crash in between leaves the snapshot without its log (still
        # corrupt: run it again), never the corrupt log where a next store empties it.
        with contextlib.suppress(FileNotFoundError):
            os.rename(cp.log_path, _log_of(target))
        os.rename(cp.path, target)
        fsync_dir(cp.data_dir)
        carried = carried_entries(salvage_entries(target), owned_mig)
        if carried:
            cp.store(carried)
        return target
