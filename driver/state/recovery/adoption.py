"""Adopting, at the plugin's start, a running claim whose completion record a corrupt
journal lost (docs/state.md, "MIG devices after a quarantine").

Salvaging a corrupt journal yields a claim's `PrepareStarted` intent when the corrupt
line was its completion record; its pod may run on the MIG device that prepare
created. `gpu-dra journal quarantine --owned-mig adopt` carries such an intent marked
`adopt`, and the next start, under the node lock and before any rollback, completes
it from the live device when that is unambiguous:

- the claim's CDI spec is in place (the prepare wrote it; a rollback removes it);
- each MIG device the intent owns has, at its placement, the one instance its attempt
  can have created (its profile, an id not in `before`, no other entry's, this boot)
  with a compute instance, and the spec names that instance's MIG UUID;
- no device sets a time-slice interval (whether the lost completion had set it is
  unknown).

The entry then becomes `PrepareCompleted` with those ids and UUIDs and the spec as it
is on disk: the claim keeps its device until its unprepare destroys it. Where the
answer is no, the intent is rolled back as any other (its spec removed, the instance
its attempt created destroyed), as the quarantine's preview said it may be. Where a
transient error keeps the start from telling (an NVML listing error, `EMFILE` reading
the spec), nothing is decided: the intent stays, marked `adopt`, for the next start,
and nothing of it is rolled back or destroyed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from driver.cdi.claim_specs import ClaimSpec
from driver.errors import DriverError
from driver.fileio import UnsafeFileError
from driver.state.context import StepContext
from driver.state.journal.checkpoint import ClaimEntry, ClaimState, PreparedDevice
from driver.state.mig_instances import completed_record, other_entries

log = logging.getLogger(__name__)


class NotAdoptable(Exception):
    """Why a carried intent is rolled back instead."""


class AdoptionDeferred(Exception):
    """A transient error kept this start from deciding: the intent waits for the next."""


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
        except DriverError as err:
            if err.permanent:
                _rolled_back(uid, err)
                continue
            deferred[uid] = str(err)
        except AdoptionDeferred as err:
            deferred[uid] = str(err)
        except NotAdoptable as why:
            _rolled_back(uid, why)
            continue
        else:
            adopted.append(uid)
            continue
        log.warning(
            "claim %s: carried by a quarantine to be adopted, but this start cannot tell "
            "whether it may be (%s): left for the next start, nothing rolled back",
            uid,
            deferred[uid],
        )
    if adopted:
        log.warning(
            "adopted %d claim(s) whose completion record the quarantined journal lost: %s",
            len(adopted),
            adopted,
        )
    return Adoption(adopted, deferred)


def _rolled_back(uid: str, why: Exception) -> None:
    log.warning("claim %s: carried by a quarantine to be adopted, but %s: rolled back", uid, why)


def _completed(
    state: StepContext, uid: str, entry: ClaimEntry, journal: Mapping[str, ClaimEntry]
) -> ClaimEntry:
    spec = _spec_on_disk(state, uid)
    named = {value for device in spec.devices for value in _env_values(device.env)}
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
    except UnsafeFileError as err:
        raise NotAdoptable(f"its CDI spec cannot be read: {err}") from None
    except OSError as err:  # EMFILE, EIO: another start may read it
        raise AdoptionDeferred(f"its CDI spec cannot be read now: {err}") from None
    except ValueError as err:
        raise NotAdoptable(f"its CDI spec cannot be read: {err}") from None
    if doc is None:
        raise NotAdoptable("its CDI spec is gone")
    try:
        return ClaimSpec.from_json(
            {"devices": doc.get("devices"), "deviceNodes": _spec_wide_nodes(doc)}
        )
    except ValueError as err:
        raise NotAdoptable(f"its CDI spec is malformed: {err}") from None


def _spec_wide_nodes(doc: Mapping[str, Any]) -> list[object]:
    edits = doc.get("containerEdits")
    nodes = edits.get("deviceNodes") if isinstance(edits, Mapping) else None
    return [n.get("path") if isinstance(n, Mapping) else n for n in nodes or []]


def _env_values(env: tuple[str, ...]) -> set[str]:
    return {item.split("=", 1)[1] for item in env if "=" in item}
