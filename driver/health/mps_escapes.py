"""Processes outside MPS on a GPU with cooperative MPS shares: seen where they cannot be
prevented (docs/mps.md, "Escapes").

The GPU stays in compute mode `Default` so that several claims' MPS servers can share
it; a process that opens the GPU without MPS (one that points
`CUDA_MPS_PIPE_DIRECTORY` elsewhere, another claim's process, one of the node's) gets
a CUDA context of its own, held to no MPS limit. Such a process cannot be kept off
the GPU, but it can be seen: NVML lists it among the GPU's compute processes and not
among its MPS clients, and it is no MPS server (`driver.nvml.processes`).

After each check of the MPS daemons (driver/state/mps_watch.py, every 30 s) the
`MpsEscapes` check lists the compute processes of every GPU that carries an MPS share
of a prepared claim. Each process outside MPS is reported once, when first seen (a
later check that still sees it reports nothing; one that ends and a new one with
another pid is reported anew):

- a Warning Event `MPSEscape` on the claim whose container runs it: the pod is read
  from the process's cgroup (`/proc/<pid>/cgroup`, `driver.nvml.cgroups`) and matched
  against each MPS claim of that GPU's `status.reservedFor`; where the pod is not
  known (the process is not visible from here) or holds none of them, the Event goes
  to every claim with an MPS share of that GPU, and says so;
- `gpu_dra_mps_escapes_total{gpu=<UUID>}` counts it;
- with `--mps-escape-taint` (off by default), every device of the GPU carries the
  taint `<driver>/mps-escape` with effect NoSchedule while such a process runs on
  it: the scheduler puts no new claim there; running pods and prepare are not
  affected. It goes at the first check that sees none left.

A process NVML cannot name (the plugin does not share the host's PID namespace) is not
taken for an escape: it could be an MPS server. That is logged once per GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from driver.errors import DriverError
from driver.health.failures import Devices, device_list, now_rfc3339, time_added
from driver.nvml.cgroups import DEFAULT_PROC_ROOT, process_pod_uid
from driver.nvml.processes import GpuProcess, GpuProcesses
from driver.observability import metrics
from driver.state.request import ClaimReader, ClaimRef

log = logging.getLogger(__name__)

KIND_MPS_ESCAPE: Final = "mps-escape"
REASON_ESCAPE: Final = "MPSEscape"
TAINT_EFFECT: Final = "NoSchedule"

Taints = Mapping[str, Sequence[Mapping[str, str]]]  # device name -> its taints


class CooperativeShare(Protocol):
    """An MPS-limited device of a prepared claim (`driver.state.mps_watch.DaemonState`)."""

    @property
    def claim(self) -> ClaimRef: ...
    @property
    def device(self) -> str: ...
    @property
    def gpu_uuid(self) -> str: ...


class ClaimEventSink(Protocol):
    def post(self, claim: ClaimRef, reason: str, message: str) -> None: ...


@dataclass(frozen=True)
class Escape:
    """A process seen outside MPS on a GPU with MPS shares."""

    gpu_uuid: str
    pid: int
    name: str
    used_bytes: int | None
    pod_uid: str | None  # None: not known (not visible here, or not a pod's process)
    since: str  # RFC 3339, when first seen

    def to_json(self) -> dict[str, Any]:
        return {
            "gpuUUID": self.gpu_uuid,
            "pid": self.pid,
            "name": self.name,
            "usedBytes": self.used_bytes,
            "podUID": self.pod_uid,
            "since": self.since,
        }


def reserved_pods(claim: Mapping[str, Any], uid: str) -> set[str]:
    """The UIDs of the pods a ResourceClaim (raw JSON) is reserved for; none when it is
    not the claim of that UID (deleted and made again under its name)."""
    if (claim.get("metadata") or {}).get("uid") != uid:
        return set()
    consumers = (claim.get("status") or {}).get("reservedFor") or []
    return {
        str(c["uid"])
        for c in consumers
        if isinstance(c, Mapping) and c.get("resource") == "pods" and c.get("uid")
    }


def claim_pods_from(reader: ClaimReader) -> Callable[[ClaimRef], Collection[str] | None]:
    """A claim's pods as the API server has them (None where it cannot be read)."""

    def pods(claim: ClaimRef) -> Collection[str] | None:
        try:
            return reserved_pods(reader.get(claim.namespace, claim.name), claim.uid)
        except DriverError as err:
            log.warning("cannot read claim %s/%s: %s", claim.namespace, claim.name, err)
            return None

    return pods


class MpsEscapes:
    """The check (`check`, after each MPS daemon check) and the escapes it found
    (`escapes`, `add_taints` for the slice publisher). Thread-safe."""

    def __init__(
        self,
        processes: Callable[[str], GpuProcesses],
        events: ClaimEventSink,
        devices: Devices,
        *,
        driver: str,
        claim_pods: Callable[[ClaimRef], Collection[str] | None],
        taint: bool = False,
        on_taints_changed: Callable[[], object] | None = None,
        proc_root: Path | str = DEFAULT_PROC_ROOT,
        clock: Callable[[], str] = now_rfc3339,
    ) -> None:
        self._processes = processes
        self._events = events
        self._gpu_of = {d.name: d.gpu_uuid for d in device_list(devices)}
        self.driver = driver
        self._claim_pods = claim_pods
        self.taint = taint
        self._on_taints_changed = on_taints_changed
        self._proc_root = proc_root
        self._clock = clock
        self._lock = threading.Lock()
        self._escapes: dict[tuple[str, int], Escape] = {}
        self._noted: dict[str, str] = {}  # GPU UUID -> what was last logged about it
        for uuid in sorted(set(self._gpu_of.values())):
            metrics.MPS_ESCAPES.labels(gpu=uuid)  # a series from the start: increase()

    def escapes(self) -> list[Escape]:
        with self._lock:
            return sorted(self._escapes.values(), key=lambda e: (e.gpu_uuid, e.pid))

    def add_taints(self, taints: Taints) -> dict[str, list[dict[str, str]]]:
        """`taints` with `<driver>/mps-escape:NoSchedule` on every device of a GPU that
        runs a process outside MPS (with the option on)."""
        merged = {name: [dict(t) for t in listed] for name, listed in taints.items()}
        if not self.taint:
            return merged
        with self._lock:
            since: dict[str, str] = {}
            for e in sorted(self._escapes.values(), key=lambda e: e.since):
                since.setdefault(e.gpu_uuid, e.since)
        for name, uuid in self._gpu_of.items():
            if uuid in since:
                taint = {"key": f"{self.driver}/{KIND_MPS_ESCAPE}", "effect": TAINT_EFFECT}
                merged.setdefault(name, []).append(taint | time_added(since[uuid]))
        return merged

    def check(self, shares: Sequence[CooperativeShare]) -> list[Escape]:
        """One round over the GPUs of `shares`; the escapes first seen now."""
        by_gpu: dict[str, list[CooperativeShare]] = {}
        for share in shares:
            by_gpu.setdefault(share.gpu_uuid, []).append(share)
        with self._lock:
            before = dict(self._escapes)
        found: dict[tuple[str, int], Escape] = {}
        new: list[tuple[Escape, list[CooperativeShare]]] = []
        for uuid, on_gpu in sorted(by_gpu.items()):
            try:
                listing = self._processes(uuid)
            except Exception as err:  # NVML not there at all: as a GPU that did not answer
                listing = GpuProcesses(uuid, error=str(err) or type(err).__name__)
            if listing.error:
                self._note(uuid, f"cannot list its compute processes: {listing.error}")
                found.update({k: e for k, e in before.items() if k[0] == uuid})  # unknown
                continue
            self._note_unnamed(uuid, listing.processes)
            for process in listing.processes:
                if not process.outside_mps:
                    continue
                key = (uuid, process.pid)
                known = before.get(key)
                if known is None:
                    known = self._escape(uuid, process)
                    new.append((known, on_gpu))
                found[key] = known
        with self._lock:
            changed = {e.gpu_uuid for e in found.values()} != {
                e.gpu_uuid for e in self._escapes.values()
            }
            self._escapes = found
        for escape, on_gpu in new:
            self._report(escape, on_gpu)
        if changed and self.taint and self._on_taints_changed is not None:
            self._on_taints_changed()
        return [escape for escape, _ in new]

    def _escape(self, uuid: str, process: GpuProcess) -> Escape:
        assert process.name is not None
        pod = process_pod_uid(self._proc_root, process.pid)
        return Escape(uuid, process.pid, process.name, process.used_bytes, pod, self._clock())

    def _report(self, escape: Escape, shares: Sequence[CooperativeShare]) -> None:
        metrics.MPS_ESCAPES.labels(gpu=escape.gpu_uuid).inc()
        claims = list({s.claim.uid: s.claim for s in shares}.values())
        owners: list[ClaimRef] = []
        if escape.pod_uid is not None:
            owners = [c for c in claims if escape.pod_uid in (self._claim_pods(c) or ())]
        used = "" if escape.used_bytes is None else f", {escape.used_bytes >> 20} MiB"
        what = (
            f"process {escape.pid} ({escape.name}{used}) uses GPU {escape.gpu_uuid} with a "
            "CUDA context of its own, outside MPS: no MPS limit holds for it (it may use "
            "every SM and all free memory of the GPU)"
        )
        if owners:
            whom = f"it runs in pod {escape.pod_uid}, which this claim is reserved for"
            targets = owners
        elif escape.pod_uid is not None:
            whom = (
                f"it runs in pod {escape.pod_uid}, for which none of the claims with an MPS "
                "share of this GPU is reserved: reported on each of them"
            )
            targets = claims
        else:
            whom = (
                "its pod cannot be told (no pod cgroup in /proc/<pid>/cgroup as the plugin "
                "sees it): reported on every claim with an MPS share of this GPU"
            )
            targets = claims
        taint = (
            f"; the GPU's devices carry the taint {self.driver}/{KIND_MPS_ESCAPE}:"
            f"{TAINT_EFFECT} while it runs"
            if self.taint
            else ""
        )
        message = f"{what}; {whom}{taint}"
        log.warning("MPS escape: %s", message)
        for claim in targets:
            self._events.post(claim, REASON_ESCAPE, message)

    def _note(self, uuid: str, text: str) -> None:
        if self._noted.get(uuid) != text:
            self._noted[uuid] = text
            log.warning("GPU %s: %s", uuid, text)

    def _note_unnamed(self, uuid: str, processes: Sequence[GpuProcess]) -> None:
        unnamed = sorted(p.pid for p in processes if p.name is None and not p.mps_client)
        if unnamed:
            self._note(
                uuid,
                f"NVML cannot name its compute process(es) {unnamed}: whether they run "
                "outside MPS is not known (the plugin needs the host's PID namespace)",
            )
        else:
            self._noted.pop(uuid, None)
