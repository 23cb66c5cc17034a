"""Stage 1 of a prepare (driver/state/prepare.py): the request decoded. Claims as the
kubelet names them, what prepare answers, the collaborators prepare talks to (as
protocols), and the checks a claim read from the API must pass before the node lock:
allocated to this node, for this driver, on healthy devices (`check_health`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from driver.devices.device_types import MigBacking
from driver.errors import DriverError, device_failed, transient
from driver.state.journal.checkpoint import PreparedDevice

log = logging.getLogger(__name__)

PARALLEL_READS = 8  # claim GETs in flight for one prepare request


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PrepareResult:
    """The outcome for one claim: its devices, or an error (never both)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: DriverError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class ClaimReader(Protocol):
    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """The ResourceClaim as raw JSON. Raises a transient DriverError on API errors
        (including not found)."""
        ...


class DeviceHealth(Protocol):
    def failure(self, device_name: str) -> str | None:
        """Why the device is unusable (critical Xid, lost), or None if healthy.
        Must not block on NVML: answered from the health monitor's state."""
        ...

    def ensure_tainted(self, device_name: str) -> None:
        """Return once the API server has accepted the device's taint; raise otherwise."""
        ...


class FailureReporter(Protocol):
    def permanent_failure(self, claim: dict[str, Any], error: DriverError) -> None:
        """Make a permanent failure visible: an Event on the claim and, where enabled,
        a condition in its device status. Called once per verdict; best effort."""
        ...


class PreparableDevice(Protocol):
    """What prepare needs of a published device (`driver.devices.device_types.PublishedDevice`)."""

    @property
    def name(self) -> str: ...
    @property
    def gpu_uuid(self) -> str: ...
    @property
    def gpu_minor(self) -> int | None: ...
    @property
    def is_partition(self) -> bool: ...
    @property
    def max_partitions(self) -> int | None: ...
    @property
    def profile(self) -> str | None: ...
    @property
    def placement(self) -> tuple[int, int] | None: ...
    @property
    def mig(self) -> MigBacking | None: ...
    @property
    def document(self) -> Mapping[str, Any]: ...  # the resource.k8s.io/v1 Device
    @property
    def share_capacity(self) -> Mapping[str, int] | None: ...  # None: not multi-allocatable


def unique(claims: Sequence[ClaimRef]) -> list[ClaimRef]:
    """The claims without repeated UIDs (first occurrence wins)."""
    seen: dict[str, ClaimRef] = {}
    for ref in claims:
        seen.setdefault(ref.uid, ref)
    return list(seen.values())


def read_claims(
    reader: ClaimReader, refs: Sequence[ClaimRef]
) -> list[dict[str, Any] | DriverError]:
    """Each claim (raw JSON) or why it could not be read (transient), in order. A batch
    is read with up to PARALLEL_READS requests in flight: one at a time, the 64 reads
    of a 64-claim request were most of its time."""
    if len(refs) <= 1:
        return [_read_claim(reader, ref) for ref in refs]
    workers = min(PARALLEL_READS, len(refs))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="claim-read") as pool:
        return list(pool.map(lambda ref: _read_claim(reader, ref), refs))


def _read_claim(reader: ClaimReader, ref: ClaimRef) -> dict[str, Any] | DriverError:
    try:
        claim = reader.get(ref.namespace, ref.name)
    except DriverError as err:
        return err
    except Exception as err:  # a bug in a reader must not fail the other claims
        log.exception("reading claim %s/%s failed", ref.namespace, ref.name)
        return transient(f"internal error: {err}")
    if not isinstance(claim, dict):
        return transient(f"claim {ref.namespace}/{ref.name}: API returned no object")
    return claim


def check_claim(
    ref: ClaimRef, claim: dict[str, Any], *, driver_name: str, node_name: str
) -> list[dict[str, Any]]:
    """Validate the claim read from the API against the kubelet's request; return
    this driver's allocation results. Every failure is transient."""
    where = f"claim {ref.namespace}/{ref.name}"
    uid = (claim.get("metadata") or {}).get("uid")
    if uid != ref.uid:
        raise transient(
            f"{where}: UID {uid} does not match the requested UID {ref.uid} "
            "(the claim was deleted and recreated)"
        )
    allocation = (claim.get("status") or {}).get("allocation")
    if not isinstance(allocation, dict):
        raise transient(f"{where}: claim not yet allocated")
    if not _allocated_to_node(allocation.get("nodeSelector"), node_name):
        raise transient(f"{where}: allocated to a different node, not {node_name}")
    results = (allocation.get("devices") or {}).get("results") or []
    mine = [r for r in results if isinstance(r, dict) and r.get("driver") == driver_name]
    if not mine:
        raise transient(f"{where}: no allocation results for driver {driver_name}")
    return mine


def _allocated_to_node(selector: object, node_name: str) -> bool:
    """Does an allocation's nodeSelector admit `node_name`? Only `metadata.name` field
    selectors can be evaluated here; label expressions are assumed to match."""
    terms = selector.get("nodeSelectorTerms") if isinstance(selector, dict) else None
    return not terms or any(_term_admits(t, node_name) for t in terms if isinstance(t, dict))


def _term_admits(term: dict[str, Any], node_name: str) -> bool:
    for req in term.get("matchFields") or []:
        if not isinstance(req, dict) or req.get("key") != "metadata.name":
            continue
        values = req.get("values") or []
        if req.get("operator") == "In" and node_name not in values:
            return False
        if req.get("operator") == "NotIn" and node_name in values:
            return False
    return True


def check_health(ref: ClaimRef, results: Sequence[dict[str, Any]], health: DeviceHealth) -> None:
    """A failed allocated device is tainted (waiting until the API server accepted
    the taint), then the claim fails permanently with device-failed."""
    failed: list[str] = []
    for result in results:
        name = str(result.get("device"))
        reason = health.failure(name)
        if reason is not None:
            failed.append(f"{name}: {reason}")
            try:
                health.ensure_tainted(name)
            except Exception as err:  # not permanent until the API accepted the taint
                raise transient(
                    f"device {name} failed ({reason}) but tainting it failed: {err}"
                ) from err
    if failed:
        raise device_failed(
            f"allocated device(s) unusable for claim {ref.namespace}/{ref.name}: "
            + "; ".join(failed)
            + " (tainted; the scheduler will not pick them again)"
        )
