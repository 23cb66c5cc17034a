"""Adopting, at the plugin's start, a running claim whose completion record a corrupt
journal lost (docs/state.md, "MIG devices after a quarantine", which lists the
conditions).

Salvaging a corrupt journal yields a claim's `PrepareStarted` intent when the corrupt
line was its completion record; its pod may run on the MIG device that prepare
created. `gpu-dra journal quarantine --owned-mig adopt` carries such an intent marked
`adopt`, and the next start, under the node lock and before any rollback, completes
it from the live device when that is unambiguous: the entry becomes
`PrepareCompleted` with the device's ids and UUID and the spec as it is on disk.
Otherwise the intent is rolled back as any other, as the quarantine's preview said it
may be. A transient error that keeps the start from telling decides nothing: the
intent stays, marked `adopt`, for the next start, and nothing of it is rolled back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

from driver.cdi.claim_specs import ClaimSpec
from driver.errors import DriverError, transient
from driver.fileio import UnsafeFileError
from driver.state.context import StepContext
from driver.state.journal.checkpoint import ClaimEntry, ClaimState, PreparedDevice
from driver.state.mig_instances import completed_record, other_entries

log = logging.getLogger(__name__)


class NotAdoptable(Exception):
    """Why a carried intent is rolled back instead."""


@dataclass(frozen=True)
class Adoption:
    adopted: list[str]
    deferred: dict[str, str]  # claim -> the transient error; not to be rolled back


def adopt_intents(state: StepContext, journal: dict[str, ClaimEntry], busy: set[str]) -> Adoption:
    """Under the node lock at start: each `adopt` intent that can be completed from its
    live MIG devices is replaced in `journal` by its `PrepareCompleted` entry; those a
    transient error kept from deciding are deferred (left as they are); the others are
    left to the rollback."""
    adopted: list[str] = []
    deferred: dict[str, str] = {}
    for uid, entry in sorted(journal.items()):
        if not entry.adopt or entry.state is not ClaimState.PREPARE_STARTED or uid in busy:
            continue
        try:
            journal[uid] = _completed(state, uid, entry, journal)
        except (DriverError, NotAdoptable) as err:
            if isinstance(err, NotAdoptable) or err.permanent:
                log.warning(
                    "claim %s: carried by a quarantine to be adopted, but %s: rolled back",
                    uid,
                    err,
                )
                continue
            # A transient error kept this start from deciding: the intent waits for the next.
            deferred[uid] = str(err)
            log.warning(
                "claim %s: carried by a quarantine to be adopted, but this start cannot tell "
                "whether it may be (%s): left for the next start, nothing rolled back",
                uid,
                deferred[uid],
            )
        else:
            adopted.append(uid)
    if adopted:
        log.warning(
            "adopted %d claim(s) whose completion record the quarantined journal lost: %s",
            len(adopted),
            adopted,
        )
    return Adoption(adopted, deferred)


def _completed(
    state: StepContext, uid: str, entry: ClaimEntry, journal: Mapping[str, ClaimEntry]
) -> ClaimEntry:
    spec = _spec_on_disk(state, uid)
    named = {item.split("=", 1)[1] for device in spec.devices for item in device.env if "=" in item}
    devices: list[PreparedDevice] = []
    for device in entry.devices:
        if device.time_slice is not None:
            raise NotAdoptable(f"device {device.device_name} sets a time-slice interval")
        record = device.mig
        if record is None or not record.owned:
            devices.append(device)
            continue
        if record.gi_id is not None:
            raise NotAdoptable(f"device {device.device_name} records a GPU instance already")
        instance = state.instances.created_by_attempt(
            record, device.device_name, other_entries(uid, journal)
        )
        if instance is None:
            raise NotAdoptable(
                f"no MIG device its attempt created is at the placement of "
                f"{device.device_name} (or its intent cannot tell one)"
            )
        if instance.uuid is None:
            raise NotAdoptable(f"the GPU instance of {device.device_name} has no MIG device")
        if instance.uuid not in named:
            raise NotAdoptable(f"its CDI spec does not name {instance.uuid}")
        devices.append(replace(device, mig=completed_record(record, instance)))
    return replace(
        entry,
        state=ClaimState.PREPARE_COMPLETED,
        devices=tuple(devices),
        cdi_spec=spec,
        adopt=False,
    )


def _spec_on_disk(state: StepContext, uid: str) -> ClaimSpec:
    try:
        doc = state.cdi.read_claim_spec(uid)
    except (UnsafeFileError, ValueError) as err:
        raise NotAdoptable(f"its CDI spec cannot be read: {err}") from None
    except OSError as err:  # EMFILE, EIO: another start may read it
        raise transient(f"its CDI spec cannot be read now: {err}") from None
    if doc is None:
        raise NotAdoptable("its CDI spec is gone")
    edits = doc.get("containerEdits")
    nodes = edits.get("deviceNodes") if isinstance(edits, Mapping) else None
    paths = [n.get("path") if isinstance(n, Mapping) else n for n in nodes or []]
    try:
        return ClaimSpec.from_json({"devices": doc.get("devices"), "deviceNodes": paths})
    except ValueError as err:
        raise NotAdoptable(f"its CDI spec is malformed: {err}") from None
