"""Strict partitions: one MPS server per GPU for every partition claim on it
(docs/mps.md, "Strict partitions: one server per GPU").

With `--mps-strict-partitions` the `--gpu-partitions` partitions of a GPU of Volta or
later publish `mpsIsolation: "strict"` (driver/devices/model.py). EXCLUSIVE_PROCESS
lets one CUDA context on the GPU, so its partition claims cannot each have a server:
they share one control daemon, and so one server, whose default limits are the
partition's (the partitions are equal, so every claim's are the same). A claim's own
lower MPS limits reach its containers as CUDA_MPS_* variables, which only lower the
server's (NVIDIA's MPS documentation); a process that drops them gets the partition's.

Each claim's journal record names that daemon (`MpsRecord.shared`, its directory the
GPU's: `shared_directory`). What is per device elsewhere is per GPU here, decided
from the journal under the node lock:

- the first claim reads the compute mode and starts the daemon; a later one takes
  the mode found from a record of the daemon (`inherited_mode`, before its intent
  is stored: the GPU is in EXCLUSIVE_PROCESS by then) and joins the daemon running
  (`joinable`), never starting a second one;
- a rollback or an unprepare stops the daemon and puts the mode back only when no
  other claim's record names it (`holders`), so the last claim to go does;
- a daemon found gone is started again once: the next claim's check finds it
  running and takes its identity (`joinable`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import replace

from driver.state.journal.checkpoint import ClaimEntry
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.compute_modes import published_strict
from driver.state.mps.daemons import daemon_directory
from driver.state.mps.prepared_limits import Allotment, MpsLimits
from driver.state.request import PreparableDevice


def shared_directory(gpu_uuid: str) -> str:
    """The directory of a GPU's shared daemon under the MPS root (a digest, like a
    device's, of a name no CDI device has)."""
    return daemon_directory(f"gpu/{gpu_uuid}")


def server_limits(device: PreparableDevice, given: Allotment | None) -> MpsLimits | None:
    """The shared server's limits for a strict partition: the partition's memory and
    SM share. None for any other device (its daemon is its own)."""
    if given is None or not device.is_partition or not published_strict(device):
        return None
    return MpsLimits(given.percentage, given.memory_limit)


def holders(
    journal: Mapping[str, ClaimEntry], record: MpsRecord, *, besides: Collection[str]
) -> Iterator[MpsRecord]:
    """The records of claims other than `besides` that name the shared daemon of
    `record`, intents included."""
    for uid, entry in journal.items():
        if uid in besides:
            continue
        for device in entry.devices:
            other = device.mps
            if other is not None and other.shared and other.directory == record.directory:
                yield other


def inherited_mode(
    journal: Mapping[str, ClaimEntry], record: MpsRecord, *, besides: Collection[str]
) -> int | None:
    """The compute mode the GPU of `record`'s shared daemon had before its first claim
    (what the last claim puts back), from another claim's record; None where no
    other claim names the daemon."""
    found = (h.compute_mode_before for h in holders(journal, record, besides=besides))
    return next((mode for mode in found if mode is not None), None)


def with_daemon_of(record: MpsRecord, running: MpsRecord) -> MpsRecord:
    """`record` naming the daemon of `running` (pid and start time, or Deployment and
    pod), which serves the same directory."""
    return replace(
        record,
        pid=running.pid,
        start_time=running.start_time,
        deployment=running.deployment,
        deployment_uid=running.deployment_uid,
        pod_uid=running.pod_uid,
        pod_restarts=running.pod_restarts,
    )
