"""MIG devices of prepared claims: created at prepare, destroyed at unprepare, and
reconciled with the journal at start (docs/mig.md, "Crash safety").

The journal names each owned MIG device by GPU, profile and placement before it is
created (`PrepareStarted`), with the ids of the instances already there
(`MigRecord.before`, normally none) and the boot, and adds the GI/CI ids and UUID
once it exists (`PrepareCompleted`). A crash's leftover, even a GI without its CI, is
found at the placement: the instance of the intent's profile whose id is not in
`before` and that no other entry records; an intent without `before` (an earlier
release's) or of another boot destroys nothing, and the undo of a failed prepare in
its own process destroys only the ids it recorded. Destroying by id first checks the
recorded profile, placement and MIG UUID (an id follows the placement: a device
created again there by anyone has the recorded ids, not the UUID). Static (not
owned) MIG devices are never created or destroyed here.

Every failure is a transient `DriverError` naming the device and NVML's code. A
lost GPU (or one no longer on the node) fails the prepare of its devices,
transiently (the health check then answers device-failed once the taint is in). For
teardown its MIG device counts as destroyed: the GPU comes back only through a GPU
reset or a reboot, and both destroy every instance on it (docs/mig.md, "A lost GPU").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from driver.errors import DriverError, transient
from driver.failpoints import failpoint
from driver.nvml.discovered import MigInstance
from driver.nvml.mig.mig_manager import MigError, MigTarget, RecordedInstance
from driver.state.journal.checkpoint import ClaimEntry, MigRecord, PreparedDevice
from driver.state.journal.journal_entries import boot_id
from driver.state.spec_render import PlannedDevice, with_mig

log = logging.getLogger(__name__)


class MigOps(Protocol):
    """`driver.nvml.mig.mig_manager.MigManager`, or a test double."""

    def create(self, target: MigTarget) -> MigInstance: ...
    def destroy(
        self, gpu_uuid: str, gi_id: int, recorded: RecordedInstance | None = None
    ) -> bool: ...
    def instances(self, gpu_uuid: str) -> list[MigInstance]: ...
    def instance_ids_at(
        self, gpu_uuid: str, profile_id: int, placement: tuple[int, int]
    ) -> tuple[int, ...]: ...


def _target(record: MigRecord) -> MigTarget:
    return MigTarget(record.gpu_uuid, record.profile_id, record.placement, record.slice_count)


def completed_record(record: MigRecord, instance: MigInstance) -> MigRecord:
    """The record with the ids and UUID of its live instance."""
    return replace(
        record,
        gi_id=instance.gi_id,
        ci_id=instance.ci_id,
        uuid=instance.uuid,
        before=None,
        boot=None,  # the UUID tells this device from any other from now on
    )


def _of_another_boot(record: MigRecord, boot: str) -> bool:
    """A record without a UUID (an intent, a GPU instance a failed create left)
    journaled in another boot: nothing its attempt made survived the reboot."""
    return record.uuid is None and record.boot is not None and boot != "" and record.boot != boot


Held = frozenset[tuple[str, int]]  # (GPU UUID, GPU-instance id)
Place = tuple[str, int, tuple[int, int]]  # (GPU UUID, profile id, placement)


def held(devices: Iterable[Sequence[PreparedDevice]]) -> Held:
    """The GPU instances the devices' records name (owned or static): a rollback or
    an unprepare of another claim never destroys one of them."""
    return frozenset(
        (d.mig.gpu_uuid, d.mig.gi_id)
        for group in devices
        for d in group
        if d.mig is not None and d.mig.gi_id is not None
    )


def owned_instances(journal: Mapping[str, ClaimEntry], live: Iterable[MigInstance]) -> Held:
    """The live GPU instances the journal owns: each owned record's by its ids and,
    where recorded, its MIG device's UUID (a device created again at the placement by
    someone else has the same ids, not the UUID), and for an intent (`PrepareStarted`,
    no ids yet) the one its attempt may have created, found as a rollback finds it
    (the intent's profile at its placement, an id not in `before` and not another
    entry's). A rollback or unprepare destroys exactly these, so none of them may be
    published as a static device."""
    live = list(live)
    boot = boot_id()
    records = [
        d.mig
        for e in journal.values()
        for d in e.devices
        if d.mig is not None and not _of_another_boot(d.mig, boot)
    ]
    recorded = {(r.gpu_uuid, r.gi_id): r.uuid for r in records if r.owned and r.gi_id is not None}
    owned = {
        (m.gpu_uuid, m.gi_id)
        for m in live
        if (m.gpu_uuid, m.gi_id) in recorded
        and _is_recorded_device(m, recorded[(m.gpu_uuid, m.gi_id)])
    }
    others = held([[d for e in journal.values() for d in e.devices]]) - owned
    for r in records:
        if r.owned and r.gi_id is None and r.before is not None:
            owned.update(
                (m.gpu_uuid, m.gi_id)
                for m in live
                if m.gpu_uuid == r.gpu_uuid
                and _same_place(m, r)
                and m.gi_id not in r.before
                and (m.gpu_uuid, m.gi_id) not in others
            )
    return frozenset(owned)


def other_entries(
    uid: str, journal: Mapping[str, ClaimEntry]
) -> Iterable[Sequence[PreparedDevice]]:
    """The devices of every journal entry but `uid`'s (lazily: read only when the claim
    has an owned MIG device to destroy)."""
    return (entry.devices for key, entry in journal.items() if key != uid)


def _same_place(instance: MigInstance, record: MigRecord) -> bool:
    return (instance.placement, instance.profile_id) == (record.placement, record.profile_id)


def _is_recorded_device(instance: MigInstance, uuid: str | None) -> bool:
    """Is the instance at a record's ids still the record's? Its MIG device has the
    recorded UUID, or it has none: no MIG device runs on a GPU instance without a
    compute instance, and one at the recorded ids is what is left of the record's (a
    teardown killed between its two destroys, a compute instance destroyed by hand)."""
    return uuid is None or instance.uuid is None or instance.uuid == uuid


def _why_not_ours(record: MigRecord, instance: MigInstance) -> str:
    if record.before is None:
        return "the intent predates records of what was there before it"
    if instance.gi_id in record.before:
        return "it was there before the intent"
    return "another claim records it"


def _refusal(device: str, err: MigError) -> DriverError:
    if err.gpu_gone:
        hint = (
            "the GPU is lost (fallen off the bus) or no longer on this node; its "
            "devices are tainted once the health monitor sees it, and it needs a GPU "
            "reset or a reboot"
        )
    elif err.code == "NVML_ERROR_INSUFFICIENT_RESOURCES":
        hint = (
            "the placement is occupied (a MIG device created outside this driver, or one "
            "not yet destroyed); a retry succeeds once it is gone"
        )
    elif err.retryable:
        hint = "a retry may succeed"
    else:
        hint = "a retry cannot help until an administrator fixes the GPU's MIG setup"
    return transient(f"device {device}: {err}; {hint}")


class ClaimInstances:
    """The MIG side of prepare and unprepare. `ops` is None on nodes without MIG
    support in the backend; then a device that needs a MIG device fails."""

    def __init__(self, ops: MigOps | None) -> None:
        self._ops = ops

    def _need_ops(self, device: str) -> MigOps:
        if self._ops is None:
            raise transient(f"device {device}: this backend cannot manage MIG devices")
        return self._ops

    # -- prepare -----------------------------------------------------------------------

    def note_occupants(
        self, planned: Sequence[PlannedDevice], seen: dict[Place, tuple[int, ...]]
    ) -> tuple[PlannedDevice, ...]:
        """The claim's owned MIG intents with `before` set: the ids of the instances of
        their profile at their placement now (`seen` caches them per place for the
        batch). Before the `PrepareStarted` store, after the rollback of found
        entries. Raises a transient error naming the device."""
        out: list[PlannedDevice] = []
        for p in planned:
            record = p.prepared.mig
            if record is None or not record.owned or record.gi_id is not None:
                out.append(p)
                continue
            place = (record.gpu_uuid, record.profile_id, record.placement)
            if place not in seen:
                try:
                    seen[place] = self._need_ops(p.prepared.device_name).instance_ids_at(*place)
                except MigError as err:
                    raise _refusal(p.prepared.device_name, err) from err
            out.append(with_mig(p, replace(record, before=seen[place], boot=boot_id() or None)))
        return tuple(out)

    def create(
        self, planned: Sequence[PlannedDevice]
    ) -> tuple[tuple[PlannedDevice, ...], Exception | None]:
        """Create the claim's owned MIG devices in order until one fails. Returns the
        devices, each one created with its ids (and a GPU instance a failed create
        left behind with its id), and the failure (None when all were created): the
        caller's undo destroys exactly the ids recorded here (`undo_created`), never
        what sits at an intent's placement."""
        done = list(planned)
        for i, p in enumerate(planned):
            record = p.prepared.mig
            if record is None or not record.owned:
                continue
            try:
                ops = self._need_ops(p.prepared.device_name)
                failpoint("prepare-before-mig-create")
                instance = ops.create(_target(record))
            except MigError as err:
                if err.left_gi_id is not None:
                    done[i] = with_mig(p, replace(record, gi_id=err.left_gi_id, before=None))
                return tuple(done), _refusal(p.prepared.device_name, err)
            except Exception as exc:
                return tuple(done), exc
            done[i] = with_mig(p, completed_record(record, instance))
            failpoint("prepare-after-mig-create")
        return tuple(done), None

    # -- unprepare ---------------------------------------------------------------------

    def destroy(
        self, devices: Sequence[PreparedDevice], others: Iterable[Sequence[PreparedDevice]]
    ) -> None:
        """Destroy the owned MIG devices of a claim as the journal records them
        (unprepare; the rollback of an entry an earlier attempt or process left):
        never an instance that `others` (the other journal entries, other claims of
        the batch) record. An intent without ids is looked for at its placement (see
        the module doc). Raises a transient error; what is gone stays gone, a repeat
        finishes."""
        self._destroy_each(devices, others, find_intents=True)

    def undo_created(
        self, devices: Sequence[PreparedDevice], others: Iterable[Sequence[PreparedDevice]]
    ) -> None:
        """Destroy what this process's attempt created for the claim, by the ids it
        recorded (`create`): an intent still without ids made nothing (a failed
        create destroys its own half-made instance, or reports its id), so whatever
        sits at its placement is someone else's and stays. Raises as `destroy`."""
        self._destroy_each(devices, others, find_intents=False)

    def _destroy_each(
        self,
        devices: Sequence[PreparedDevice],
        others: Iterable[Sequence[PreparedDevice]],
        *,
        find_intents: bool,
    ) -> None:
        keep: Held | None = None
        for device in devices:
            record = device.mig
            if record is None or not record.owned or (record.gi_id is None and not find_intents):
                continue
            if keep is None:
                keep = held(others)
            failpoint("unprepare-before-mig-destroy")
            self._destroy(record, device.device_name, keep)
            failpoint("unprepare-after-mig-destroy")

    def _live_at(
        self, record: MigRecord, device: str, keep: Held = frozenset()
    ) -> MigInstance | None:
        """The instance of the record at its placement: the one with its id, or for an
        intent (no id yet) the one its attempt created (see the module doc). Raises
        MigError."""
        live = self._need_ops(device).instances(record.gpu_uuid)
        if record.gi_id is not None:
            found = next(
                (m for m in live if _same_place(m, record) and m.gi_id == record.gi_id), None
            )
            if found is not None and not _is_recorded_device(found, record.uuid):
                raise transient(
                    f"device {device}: the MIG device at its placement on {record.gpu_uuid} "
                    f"(GPU instance {found.gi_id}, {found.uuid}) is not the claim's "
                    f"({record.uuid}): created again by someone else (after a reboot, or "
                    "behind the driver's back); not adopted, not destroyed. The claim's pods "
                    "cannot use their device; an administrator removes that device, or the "
                    "claim is unprepared"
                )
            return found
        there = [m for m in live if _same_place(m, record)]
        ours = [
            m
            for m in there
            if record.before is not None
            and m.gi_id not in record.before
            and (record.gpu_uuid, m.gi_id) not in keep
        ]
        for m in there:
            if m not in ours:
                log.warning(
                    "device %s: GPU instance %d at placement %s on %s is not this attempt's "
                    "(%s); left alone",
                    device,
                    m.gi_id,
                    record.placement,
                    record.gpu_uuid,
                    _why_not_ours(record, m),
                )
        return ours[0] if ours else None

    def _destroy(self, record: MigRecord, device: str, keep: Held = frozenset()) -> None:
        name = device or f"MIG {record.placement} on {record.gpu_uuid}"
        if _of_another_boot(record, boot_id()):
            log.info(
                "device %s: its record is of an earlier boot (%s); the reboot destroyed "
                "whatever its attempt created, and what is at %s now is not its",
                name,
                record.boot,
                record.placement,
            )
            return
        try:
            gi_id = record.gi_id
            if gi_id is None:  # an intent: the instance its attempt created, if any
                instance = self._live_at(record, name, keep)
                if instance is None:
                    return  # none was created, or what is there is not ours
                gi_id = instance.gi_id
            if (record.gpu_uuid, gi_id) in keep:
                log.error(
                    "device %s: GPU instance %d on %s is recorded by another claim as well; "
                    "left alone",
                    name,
                    gi_id,
                    record.gpu_uuid,
                )
                return
            # By id, checked against the record (gone already: a repeated unprepare,
            # a reboot; another device under the id: left alone).
            recorded = RecordedInstance(
                record.profile_id, record.placement, record.ci_id, record.uuid
            )
            self._need_ops(name).destroy(record.gpu_uuid, gi_id, recorded)
        except MigError as err:
            if not err.gpu_gone:
                raise _refusal(name, err) from err
            # Nothing can use or free it until a GPU reset or a reboot, and both
            # destroy it: the obligation ends with the GPU (docs/mig.md).
            log.warning(
                "device %s: its MIG device (%s) counts as destroyed: %s", name, record.uuid, err
            )
        except DriverError:
            raise
        except Exception as err:  # a bug or an unexpected answer: this claim only
            log.exception("destroying the MIG device of %s failed", name)
            raise transient(f"device {name}: {type(err).__name__}: {err}") from err

    # -- start -------------------------------------------------------------------------

    def created_by_attempt(
        self, record: MigRecord, device: str, others: Iterable[Sequence[PreparedDevice]]
    ) -> MigInstance | None:
        """The live instance an intent's attempt created, as its rollback would find it
        (see the module doc): None for a record with ids, an intent without `before`
        or of another boot, or when there is none. Raises a transient error."""
        if record.gi_id is not None or record.before is None or _of_another_boot(record, boot_id()):
            return None
        try:
            return self._live_at(record, device, held(others))
        except MigError as err:
            raise _refusal(device, err) from err

    def restore(self, devices: Sequence[PreparedDevice]) -> tuple[PreparedDevice, ...] | None:
        """A completed claim's owned MIG devices after a restart: each must still be at
        its placement; one that is gone (a reboot destroys every MIG device) is created
        again there. Returns the devices with the new ids/UUIDs, or None if nothing
        changed. Raises a transient error if a device cannot be recreated."""
        changed = False
        out: list[PreparedDevice] = []
        for device in devices:
            record = device.mig
            if record is None or not record.owned:
                out.append(device)
                continue
            try:
                live = self._live_at(record, device.device_name)
                if live is not None and live.uuid is None:
                    # Its GPU instance without its MIG device: destroyed, then created
                    # again whole, as after a reboot.
                    self._destroy(record, device.device_name)
                    live = None
                if live is None:
                    live = self._need_ops(device.device_name).create(_target(record))
                    changed = True
                    log.warning(
                        "recreated the MIG device of %s for a prepared claim (was %s, now %s)",
                        device.device_name,
                        record.uuid,
                        live.uuid,
                    )
            except MigError as err:
                raise _refusal(device.device_name, err) from err
            out.append(replace(device, mig=completed_record(record, live)))
        return tuple(out) if changed else None
