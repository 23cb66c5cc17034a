"""Strict MPS: the compute mode of a GPU whose one MPS daemon holds it whole
(docs/mps.md, "Strict: one MPS server, EXCLUSIVE_PROCESS"; docs/state.md, "Recovery
rules").

A device published with `mpsIsolation: "strict"` (driver/devices/model.py: a whole GPU
of Volta or later that is neither a partition nor shared by capacity) and prepared with
an MPS daemon has the only MPS server of its GPU. There, as NVIDIA's driver does, the
GPU is put in compute mode EXCLUSIVE_PROCESS before the daemon starts: the server
holds the GPU's one CUDA context and a process outside MPS cannot open one. Every
step keeps the journal ahead of the GPU, so no GPU stays in EXCLUSIVE_PROCESS that no
entry names:

- before the intent is stored (`note`, the apply stage's pre-intent step), the mode
  found is read and recorded in the device's MPS record (`computeModeBefore`);
- prepare sets EXCLUSIVE_PROCESS (`make_exclusive`) before it starts the daemon;
- a rollback (a failed prepare, a `PrepareStarted` entry of a crash) and unprepare
  stop the daemon, then put back the mode found (`restore`); one that fails raises,
  and the caller keeps the entry (the kubelet, or the next start, repeats);
- start re-applies EXCLUSIVE_PROCESS for every completed strict record (`reapply`):
  a reboot resets the mode to Default.

A mode found EXCLUSIVE_PROCESS (an administrator's) is left as it is, at prepare and
at restore.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from driver.devices.model import MPS_ISOLATION_ATTRIBUTE, MPS_ISOLATION_STRICT
from driver.errors import DriverError, transient
from driver.nvml.compute_mode import COMPUTE_MODE_EXCLUSIVE_PROCESS as EXCLUSIVE_PROCESS
from driver.nvml.compute_mode import mode_name
from driver.state.journal.checkpoint import ClaimEntry, ClaimState
from driver.state.journal.mps_record import MpsRecord
from driver.state.request import PreparableDevice
from driver.state.spec_render import PlannedDevice

log = logging.getLogger(__name__)


class ComputeModeOps(Protocol):
    """`driver.nvml.compute_mode.NvmlComputeModes` (real NVML or the mock's), or a
    test double. Both raise a transient DriverError naming the GPU."""

    def get(self, gpu_uuid: str) -> int: ...

    def set(self, gpu_uuid: str, mode: int) -> None: ...


def published_strict(device: PreparableDevice | None) -> bool:
    """Does the device publish `mpsIsolation: "strict"` (its one daemon holds the GPU
    in EXCLUSIVE_PROCESS)?"""
    if device is None:
        return False
    attributes: Mapping[str, Any] = device.document.get("attributes") or {}
    value = attributes.get(MPS_ISOLATION_ATTRIBUTE) or {}
    return bool(value.get("string") == MPS_ISOLATION_STRICT)


class ClaimComputeModes:
    """The compute-mode side of strict MPS devices. `ops` None: this plugin cannot set
    compute modes, and a device published strict is refused (transient)."""

    def __init__(self, ops: ComputeModeOps | None) -> None:
        self._ops = ops

    def _ops_for(self, gpu_uuid: str) -> ComputeModeOps:
        if self._ops is None:
            raise transient(
                f"GPU {gpu_uuid} is published with mpsIsolation strict, and this plugin "
                "cannot set compute modes"
            )
        return self._ops

    def _get(self, gpu_uuid: str) -> int:
        try:
            return int(self._ops_for(gpu_uuid).get(gpu_uuid))
        except DriverError:
            raise
        except Exception as err:  # NVML unavailable, a bug in an implementation
            raise transient(f"cannot read the compute mode of GPU {gpu_uuid}: {err}") from err

    def _set(self, gpu_uuid: str, mode: int) -> None:
        try:
            self._ops_for(gpu_uuid).set(gpu_uuid, mode)
        except DriverError:
            raise
        except Exception as err:
            raise transient(
                f"cannot set the compute mode {mode_name(mode)} on GPU {gpu_uuid}: {err}"
            ) from err

    # -- prepare -----------------------------------------------------------------------

    def note(
        self,
        planned: Sequence[PlannedDevice],
        devices: Mapping[str, PreparableDevice],
        inherited: Callable[[MpsRecord], int | None] | None = None,
    ) -> tuple[PlannedDevice, ...]:
        """Before the intent is stored: each device with an MPS daemon that is
        published strict records the compute mode its GPU has now, or, for a shared
        daemon another claim started, the mode it found (`inherited`, from its records:
        driver/state/mps/shared.py). Raises a transient error (the claim fails;
        nothing was changed)."""
        out: list[PlannedDevice] = []
        for p in planned:
            record = p.prepared.mps
            if record is not None and published_strict(devices.get(p.prepared.device_name)):
                found = inherited(record) if record.shared and inherited is not None else None
                before = found if found is not None else self._get(record.gpu_uuid)
                record = replace(record, compute_mode_before=before)
                p = replace(p, prepared=replace(p.prepared, mps=record))
            out.append(p)
        return tuple(out)

    def make_exclusive(self, record: MpsRecord) -> None:
        """Before a strict record's daemon starts: its GPU in EXCLUSIVE_PROCESS (the
        intent, with the mode found, is durable). Set even where it is already (a
        retry, a start after a crash): NVML's set is idempotent, and one read fewer."""
        if record.strict and record.compute_mode_before != EXCLUSIVE_PROCESS:
            self._set(record.gpu_uuid, EXCLUSIVE_PROCESS)

    def restore(self, record: MpsRecord) -> None:
        """After a strict record's daemon stopped: its GPU back in the mode found
        (nothing where that was EXCLUSIVE_PROCESS). Raises a transient error."""
        before = record.compute_mode_before
        if before is None or before == EXCLUSIVE_PROCESS:
            return
        if self._get(record.gpu_uuid) != before:
            self._set(record.gpu_uuid, before)

    # -- start -------------------------------------------------------------------------

    def reapply(self, journal: Mapping[str, ClaimEntry], exclude: Collection[str]) -> None:
        """At start: the GPU of every completed strict record (but those of claims in
        `exclude`, another instance's) in EXCLUSIVE_PROCESS again (a reboot reset it).
        A failure is logged at ERROR; the claim stays prepared, its daemon cooperative
        until the next start."""
        for uid, entry in sorted(journal.items()):
            if uid in exclude or entry.state is not ClaimState.PREPARE_COMPLETED:
                continue
            for device in entry.devices:
                record = device.mps
                if record is None or not record.strict:
                    continue
                try:
                    if self._get(record.gpu_uuid) != EXCLUSIVE_PROCESS:
                        self._set(record.gpu_uuid, EXCLUSIVE_PROCESS)
                except DriverError as err:
                    log.error(
                        "claim %s: its GPU %s is not in EXCLUSIVE_PROCESS again: %s; its MPS "
                        "limits are cooperative until this succeeds",
                        uid,
                        record.gpu_uuid,
                        err,
                    )
