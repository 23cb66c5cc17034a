"""Moving a corrupt journal aside, and what becomes of the MIG devices it owned
(docs/state.md, "Corrupt checkpoint" and "MIG devices after a quarantine").

`quarantine_checkpoint` renames `checkpoint.json` and `checkpoint.log` to
`<name>.corrupt-<UTC time>` (kept for inspection) so the plugin prepares again from a
new journal. The MIG devices the driver created for the old journal's claims are
then nobody's unless the operator says otherwise (`OwnedMig`): `foreign` carries
nothing over (they are an administrator's); `adopt` carries the readable entries that
own MIG devices as they were, an entry salvaged as its `PrepareStarted` intent (the
corrupt line may have been its completion record) marked `adopt`
(driver/state/recovery/adoption.py); `destroy` carries them as half-done prepares,
which the next start rolls back.

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
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from driver.fileio import atomic_write, fsync_dir, read_file_nofollow
from driver.state.journal.checkpoint import (
    CHECKPOINT_FILE,
    CORRUPT_SUFFIX,
    SCHEMA_VERSION,
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
)
from driver.state.journal.journal_entries import boot_id
from driver.state.journal.journal_log import LOG_FILE
from driver.state.journal.locking import SerializeLock
from driver.state.journal.start_fate import next_start

# A quarantine begun and not finished: {"stamp", "ownedMig"} (`PendingQuarantine`).
INTENT_FILE = "quarantine-intent.json"


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
    raw = doc.get("entries")
    entries: dict[str, ClaimEntry] = {}
    for uid, entry in raw.items() if isinstance(raw, dict) else ():
        _salvage(entries, uid, entry)
    if doc.get("schemaVersion") == SCHEMA_VERSION:
        return entries  # a log beside it is stale
    log = _log_of(path)
    if path.name == CHECKPOINT_FILE and not os.path.lexists(log):
        log = orphan_log_copy(path.parent) or log
    try:
        lines = read_file_nofollow(log).splitlines()
    except OSError:
        return entries
    for line in lines:
        record = _object(line)
        changed, deleted = record.get("set"), record.get("delete")
        for uid, entry in changed.items() if isinstance(changed, dict) else ():
            _salvage(entries, uid, entry)
        for uid in deleted if isinstance(deleted, list) else ():
            entries.pop(str(uid), None)
    return entries


def _parsed(path: Path) -> dict[str, Any]:
    """The JSON object in the file; {} if it cannot be read or holds none."""
    try:
        return _object(read_file_nofollow(path))
    except OSError:
        return {}


def _object(data: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _salvage(entries: dict[str, ClaimEntry], uid: object, entry: object) -> None:
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        entries[str(uid)] = ClaimEntry.from_json(entry)


def orphan_log_copy(data_dir: Path) -> Path | None:
    """The newest `checkpoint.log.corrupt-<stamp>` without its snapshot's copy: a
    quarantine of an earlier release (which kept no record) killed between its two
    renames moved the live snapshot's log aside. None if there is none."""
    try:
        names = os.listdir(data_dir)
    except OSError:
        return None
    prefix = LOG_FILE + CORRUPT_SUFFIX
    orphans = [
        name
        for name in names
        if name.startswith(prefix) and CHECKPOINT_FILE + name.removeprefix(LOG_FILE) not in names
    ]
    return data_dir / max(orphans) if orphans else None


def _log_of(snapshot: Path) -> Path:
    """The log of a snapshot: `checkpoint.log<suffix>` beside `checkpoint.json<suffix>`."""
    suffix = snapshot.name.removeprefix(CHECKPOINT_FILE)
    return snapshot.with_name(LOG_FILE + suffix)


def owning_mig(entries: dict[str, ClaimEntry]) -> dict[str, ClaimEntry]:
    """The entries that own a MIG device (one the driver created for the claim)."""
    return {uid: e for uid, e in entries.items() if any(d.owns_mig for d in e.devices)}


def carried_entries(entries: dict[str, ClaimEntry], owned_mig: OwnedMig) -> dict[str, ClaimEntry]:
    """What the new journal starts with for `owned_mig` (see the module doc)."""
    owning = owning_mig(entries)
    if owned_mig is OwnedMig.ADOPT:
        return {
            uid: replace(entry, adopt=entry.state is ClaimState.PREPARE_STARTED)
            for uid, entry in owning.items()
        }
    if owned_mig is OwnedMig.DESTROY:
        return {
            uid: replace(entry, state=ClaimState.PREPARE_STARTED, unpreparing=None)
            for uid, entry in owning.items()
        }
    return {}


def carried_fate(
    uid: str, entry: ClaimEntry, owned_mig: OwnedMig, spec_present: bool | None
) -> str:
    """What becomes of an entry that owns MIG devices after a quarantine with
    `owned_mig` (`carried_entries`): not carried, or what the plugin's next start does
    with it (`start_fate.next_start`). `spec_present`: is its claim's CDI spec on
    disk (None: not known)."""
    carried = carried_entries({uid: entry}, owned_mig).get(uid)
    if carried is None:
        return "not carried: its MIG devices become foreign (an administrator's)"
    return f"carried; at the next start {next_start(carried, spec_present, boot_id())}"


@dataclass(frozen=True)
class PendingQuarantine:
    """A quarantine begun and not finished (`INTENT_FILE`): the stamp of the copies and
    the operator's choice, written durably before the first rename."""

    stamp: str
    owned_mig: OwnedMig


def pending_quarantine(data_dir: Path | str) -> PendingQuarantine | None:
    """The quarantine a killed or failed run left unfinished; None if none (or if its
    record is unreadable: then nothing was renamed yet, see `quarantine_checkpoint`)."""
    doc = _parsed(Path(data_dir) / INTENT_FILE)
    stamp, choice = doc.get("stamp"), doc.get("ownedMig")
    if not isinstance(stamp, str) or choice not in {m.value for m in OwnedMig}:
        return None
    return PendingQuarantine(stamp, OwnedMig(choice))


def quarantine_checkpoint(
    data_dir: Path | str,
    *,
    force: bool = False,
    now: datetime | None = None,
    owned_mig: OwnedMig = OwnedMig.FOREIGN,
) -> Path | None:
    """Operator action: move a corrupt journal aside (see the module doc); returns the
    snapshot's copy, None if there is no checkpoint.json.

    Resumable: the stamp and the choice are recorded (`INTENT_FILE`, durable) before
    the first rename and removed once the new journal is stored. A run that finds the
    record finishes that quarantine, with the choice recorded there, whatever it was
    asked; so does the plugin's start (`finish_pending_quarantine`).

    Refuses (ValueError) to move a checkpoint that is valid unless `force` is set.
    Takes the serialize lock, so it is safe while a plugin is running.
    """
    cp = Checkpoint(data_dir)
    with SerializeLock(cp.data_dir).hold():
        pending = pending_quarantine(cp.data_dir)
        if pending is not None:
            return _finish(cp, pending)
        if not os.path.lexists(cp.path):  # a symlink, even a dangling one, is moved aside
            return None
        if not force:
            with contextlib.suppress(CheckpointCorruptError):
                cp.load()
                raise ValueError(f"checkpoint {cp.path} is valid; not moving it (use force)")
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S.%fZ")
        doc = {"stamp": stamp, "ownedMig": owned_mig.value}
        atomic_write(cp.data_dir / INTENT_FILE, json.dumps(doc).encode())
        return _finish(cp, PendingQuarantine(stamp, owned_mig))


def finish_pending_quarantine(checkpoint: Checkpoint) -> Path | None:
    """At the plugin's start, under the node lock: finish a quarantine a killed or
    failed run left (the copies named by its stamp, the carried entries stored);
    returns the snapshot's copy, or None when there was none to finish."""
    pending = pending_quarantine(checkpoint.data_dir)
    return None if pending is None else _finish(checkpoint, pending)


def _finish(cp: Checkpoint, pending: PendingQuarantine) -> Path:
    """Move what is still in place aside under the pending stamp (a copy already there
    means that file was moved, and what sits at the journal's path now is the new
    journal), store the carried entries the new journal lacks, drop the record.
    Every step can be repeated."""
    target = cp.path.with_name(f"{CHECKPOINT_FILE}{CORRUPT_SUFFIX}{pending.stamp}")
    # The log first: a crash in between leaves the snapshot without its log, which
    # the record's stamp then moves after it, never the corrupt log where a next
    # store empties it.
    log = cp.log_path
    if not os.path.lexists(log):  # an earlier release's interrupted quarantine moved it
        log = orphan_log_copy(cp.data_dir) or log
    for source, copy in ((log, _log_of(target)), (cp.path, target)):
        if not os.path.lexists(copy):
            with contextlib.suppress(FileNotFoundError):
                os.rename(source, copy)
    fsync_dir(cp.data_dir)
    carried = carried_entries(salvage_entries(target), pending.owned_mig)
    journal = cp.load()  # the new journal: empty, or what an earlier run stored
    missing = {uid: entry for uid, entry in carried.items() if uid not in journal}
    if missing:
        cp.store({**journal, **missing})
    with contextlib.suppress(FileNotFoundError):
        os.unlink(cp.data_dir / INTENT_FILE)
    fsync_dir(cp.data_dir)
    return target
