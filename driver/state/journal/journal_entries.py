"""The entries of the prepare journal: what `checkpoint.json` and `checkpoint.log`
store per claim, their JSON form, and the canonical encoding their checksums are
computed over (docs/state.md, "The journal").

Checksums are verified against the parsed stored value, never a re-encoding through
this module's types, so a newer driver that adds a field does not invalidate older
files (the upgrade hazard NVIDIA's driver hit). Unknown keys of an entry or a device
(a newer release's) are kept and written back; inside a nested record they are not.

An entry names the boot it was made in (`boot_id`): a reboot empties the CDI root and
destroys every MIG device, so a record of an earlier boot is judged accordingly.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeGuard

from driver.cdi.claim_specs import ClaimSpec
from driver.errors import DriverError, ErrorClass
from driver.state.journal.hardware_record import HardwareRecord, MigRecord
from driver.state.journal.mps_record import MpsRecord
from driver.state.journal.timeslice_record import TimeSliceRecord

CORRUPT_SUFFIX: Final = ".corrupt-"
CHECKSUM_PREFIX: Final = "sha256:"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot of the node's kernel (the same in every container); "" if unknown."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


class ClaimState(enum.StrEnum):
    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"


Extra = tuple[tuple[str, str], ...]  # unknown keys: (key, canonical JSON of the value)


def _extra(doc: Mapping[str, Any], known: frozenset[str]) -> Extra:
    """The keys of `doc` this release does not know, to be written back unchanged."""
    return tuple(sorted((str(k), canonical(v).decode()) for k, v in doc.items() if k not in known))


def _with_extra(doc: dict[str, Any], extra: Extra) -> dict[str, Any]:
    for key, value in extra:
        doc[key] = json.loads(value)
    return doc


_DEVICE_KEYS: Final = frozenset(
    {"pool", "device", "requestNames", "cdiDeviceIds", "shareID", "adminAccess", "mig"}
    | {"consumedCapacity", "timeSlice", "hardware", "mps"}
)
_ENTRY_KEYS: Final = frozenset(
    {"state", "namespace", "name", "devices", "cdiSpec", "unpreparing", "adopt"}
)


@dataclass(frozen=True)
class PreparedDevice:
    """One device handed to the kubelet for a claim (also what the journal stores)."""

    pool_name: str
    device_name: str
    request_names: tuple[str, ...]
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None
    admin_access: bool = False
    mig: MigRecord | None = None
    # A share of a multi-allocatable device: the allocation's `consumedCapacity`
    # (capacity name -> quantity string), what the double-booking guard sums per
    # device. Stored only when present, so other entries keep their bytes.
    consumed_capacity: tuple[tuple[str, str], ...] = ()
    # The time-slice interval the driver sets on the device's GPU
    # (driver/state/claim_timeslices.py). Stored only when present.
    time_slice: TimeSliceRecord | None = None
    # The hardware the device occupies, recorded at planning
    # (driver/state/journal/hardware_record.py); None in entries of earlier releases.
    hardware: HardwareRecord | None = None
    # The device's MPS control daemon (driver/state/mps/claim_daemons.py), only when present.
    mps: MpsRecord | None = None
    # Keys a newer release wrote that this one does not know, kept on rewrite.
    extra: Extra = ()

    @property
    def owns_mig(self) -> bool:
        """Has the driver created a MIG device for it (and so destroys it)?"""
        return self.mig is not None and self.mig.owned

    @property
    def shares_the_gpu(self) -> bool:
        """Does it set how its GPU is shared (a time-slice interval, an MPS daemon),
        which its unprepare puts back under the node lock?"""
        return self.time_slice is not None or self.mps is not None

    @property
    def changes_the_node(self) -> bool:
        """Does preparing it change the node outside the data directory (a MIG device,
        a time-slice interval, an MPS daemon)? A plain device's prepare does not."""
        return self.owns_mig or self.shares_the_gpu

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "pool": self.pool_name,
            "device": self.device_name,
            "requestNames": list(self.request_names),
            "cdiDeviceIds": list(self.cdi_device_ids),
            "shareID": self.share_id,
            "adminAccess": self.admin_access,
        }
        if self.mig is not None:
            doc["mig"] = self.mig.to_json()
        if self.consumed_capacity:
            doc["consumedCapacity"] = dict(self.consumed_capacity)
        if self.time_slice is not None:
            doc["timeSlice"] = self.time_slice.to_json()
        if self.hardware is not None:
            doc["hardware"] = self.hardware.to_json()
        if self.mps is not None:
            doc["mps"] = self.mps.to_json()
        return _with_extra(doc, self.extra)

    @classmethod
    def from_json(cls, doc: object) -> PreparedDevice:
        if not isinstance(doc, Mapping):
            raise ValueError("device must be an object")
        pool, device = doc.get("pool"), doc.get("device")
        requests, ids = doc.get("requestNames"), doc.get("cdiDeviceIds")
        share, admin = doc.get("shareID"), doc.get("adminAccess", False)
        if not isinstance(pool, str) or not isinstance(device, str):
            raise ValueError("device needs string pool and device")
        if not _str_list(requests):
            raise ValueError(f"device {device}: requestNames must be a list of strings")
        if not _str_list(ids):
            raise ValueError(f"device {device}: cdiDeviceIds must be a list of strings")
        if share is not None and not isinstance(share, str):
            raise ValueError(f"device {device}: shareID must be a string or null")
        if not isinstance(admin, bool):
            raise ValueError(f"device {device}: adminAccess must be a boolean")
        mig = doc.get("mig")
        try:
            record = MigRecord.from_json(mig) if mig is not None else None
        except ValueError as err:
            raise ValueError(f"device {device}: {err}") from err
        consumed = doc.get("consumedCapacity", {})
        if not isinstance(consumed, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in consumed.items()
        ):
            raise ValueError(f"device {device}: consumedCapacity must map names to strings")
        time_slice, hardware, mps = doc.get("timeSlice"), doc.get("hardware"), doc.get("mps")
        try:
            ts = TimeSliceRecord.from_json(time_slice) if time_slice is not None else None
            hw = HardwareRecord.from_json(hardware) if hardware is not None else None
            daemon = MpsRecord.from_json(mps) if mps is not None else None
        except ValueError as err:
            raise ValueError(f"device {device}: {err}") from err
        return cls(
            pool,
            device,
            tuple(requests),
            tuple(ids),
            share,
            admin,
            record,
            tuple(sorted(consumed.items())),
            ts,
            hw,
            daemon,
            _extra(doc, _DEVICE_KEYS),
        )


def _str_list(value: object) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


@dataclass(frozen=True)
class ClaimEntry:
    """The journal entry of one claim."""

    state: ClaimState
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...] = field(default=())
    # The claim's CDI spec content, kept so a spec lost with the CDI root (a tmpfs
    # emptied by a reboot) is recreated at start without the API server. Absent in
    # entries written before it existed.
    cdi_spec: ClaimSpec | None = None
    # The boot id when an unprepare of a claim holding MIG devices the driver created
    # began (key `unpreparing`, only when set): a restart finishes the teardown rather
    # than recreate them (`unprepare_begun` below; docs/state.md).
    unpreparing: str | None = None
    # On a `PrepareStarted` entry that `gpu-dra journal quarantine --owned-mig adopt`
    # carried over (key `adopt`, only when set): the next start completes it from its
    # live MIG device instead of rolling it back, where that is unambiguous
    # (driver/state/recovery/adoption.py). An earlier release keeps the key and rolls it back.
    adopt: bool = False
    extra: Extra = ()  # keys a newer release wrote, kept on rewrite

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "state": self.state.value,
            "namespace": self.namespace,
            "name": self.name,
            "devices": [d.to_json() for d in self.devices],
        }
        if self.cdi_spec is not None:
            doc["cdiSpec"] = self.cdi_spec.to_json()
        if self.unpreparing is not None:
            doc["unpreparing"] = self.unpreparing
        if self.adopt:
            doc["adopt"] = True
        return _with_extra(doc, self.extra)

    @classmethod
    def from_json(cls, doc: object) -> ClaimEntry:
        if not isinstance(doc, Mapping):
            raise ValueError("entry must be an object")
        state = doc.get("state")
        if state not in ClaimState.__members__.values():
            raise ValueError(f"unknown state {state!r}")
        namespace, name, devices = doc.get("namespace"), doc.get("name"), doc.get("devices")
        if not isinstance(namespace, str) or not isinstance(name, str):
            raise ValueError("namespace and name must be strings")
        if not isinstance(devices, list):
            raise ValueError("devices must be a list")
        parsed = tuple(PreparedDevice.from_json(d) for d in devices)
        spec, unpreparing = doc.get("cdiSpec"), doc.get("unpreparing")
        if unpreparing is not None and not isinstance(unpreparing, str):
            raise ValueError("unpreparing must be a boot id (a string)")
        adopt = doc.get("adopt", False)
        if not isinstance(adopt, bool):
            raise ValueError("adopt must be a boolean")
        return cls(
            ClaimState(str(state)),
            namespace,
            name,
            parsed,
            ClaimSpec.from_json(spec) if spec is not None else None,
            unpreparing=unpreparing,
            adopt=adopt,
            extra=_extra(doc, _ENTRY_KEYS),
        )


class CheckpointCorruptError(DriverError):
    """The journal cannot be trusted. Transient for the kubelet (prepare is refused and
    retried); needs an operator to repair or quarantine the file."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            ErrorClass.TRANSIENT,
            f"checkpoint {path} is corrupt ({reason}); refusing to prepare until an operator "
            f"repairs it or moves it aside (`gpu-dra journal quarantine` with the plugin "
            f"stopped on this node renames the journal's files to "
            f"<name>{CORRUPT_SUFFIX}<timestamp>)",
        )


def unprepare_begun(entry: ClaimEntry, spec_exists: bool, boot: str | None = None) -> bool:
    """Had an unprepare of the completed claim begun removing things? Its entry is
    marked in this boot and its spec is gone (an unprepare removes the spec before any
    MIG device). Not after a reboot (which also destroys MIG devices and empties the
    CDI root), nor while the spec exists: the claim is then as prepared (an earlier
    release, which keeps the mark without knowing it, may have prepared it again).
    `boot`: this boot's id, if already read."""
    if entry.state is not ClaimState.PREPARE_COMPLETED or entry.unpreparing is None:
        return False
    return not spec_exists and entry.unpreparing == (boot_id() if boot is None else boot) != ""


def canonical(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def checksum(value: object) -> str:
    return CHECKSUM_PREFIX + hashlib.sha256(canonical(value)).hexdigest()
