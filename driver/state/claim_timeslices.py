"""GPU time-slice intervals of prepared claims (docs/sharing.md, "Time-slice
intervals"; docs/state.md, "Recovery rules").

A claim whose effective GpuConfig is `TimeSlicing` with a `Short`, `Medium` or `Long`
interval gets that interval set on the physical GPU of each of its devices that runs
on a whole GPU (a GPU, a share of one, a `--gpu-partitions` partition; never a MIG
device, never with admin access), as NVIDIA's driver does with
`nvidia-smi compute-policy --set-timeslice`. `Default` asks for nothing: the GPU is
left as it is (it is also what a claim without a config gets).

Each device records what it asks (`TimeSliceRecord`) in the journal: in the
`PrepareStarted` entry before the GPU is touched (the intent, `seq` 0), stamped with
an ordering `seq` in the `PrepareCompleted` entry. What a GPU should run with is a
function of the completed entries alone (`wanted`): the interval of the most
recently prepared claim that still holds it (last writer wins), `Default` when none
does. Every step converges the GPU to it:

- prepare sets the claim's interval (it is the newest);
- unprepare sets what the remaining claims want, where that differs (the last one
  gone: `Default`), before the entry is dropped, so a crash in between leaves the
  entry, and start re-applies it;
- a rollback (a failed prepare, a `PrepareStarted` entry left by a crash) sets what
  the other claims want on every GPU it may have touched; if that fails the entry
  stays `PrepareStarted` (the retry or start rolls it back again);
- start (`recover`) re-applies `wanted` to every GPU a completed claim holds (a reboot
  resets them). A GPU no entry names is never touched.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Final, Protocol

from driver.errors import DriverError, transient
from driver.nvml.smi_timeslice import GpuLostError
from driver.state.journal.checkpoint import ClaimEntry, ClaimState, PreparedDevice
from driver.state.spec_render import PlannedDevice

log = logging.getLogger(__name__)

DEFAULT: Final = "Default"


class TimeSliceOps(Protocol):
    """`driver.nvml.smi_timeslice.NvidiaSmiTimeSlice`, the mock's `MockTimeSlice`, or a
    test double."""

    def set(self, gpu_uuid: str, interval: str) -> None:
        """Set the GPU's time-slice interval (Default | Short | Medium | Long); raise a
        transient DriverError naming the GPU on failure."""
        ...


def wanted(journal: Mapping[str, ClaimEntry], exclude: Collection[str] = ()) -> dict[str, str]:
    """GPU UUID -> the interval its completed claims (but `exclude`) want: the one
    with the highest `seq`; within one claim, its last device on that GPU."""
    best: dict[str, tuple[int, str]] = {}
    for uid in sorted(journal):
        entry = journal[uid]
        if uid in exclude or entry.state is not ClaimState.PREPARE_COMPLETED:
            continue
        for device in entry.devices:
            record = device.time_slice
            if record is not None and record.seq >= best.get(record.gpu_uuid, (-1, ""))[0]:
                best[record.gpu_uuid] = (record.seq, record.interval)
    return {gpu: interval for gpu, (_, interval) in best.items()}


def _max_seq(journal: Mapping[str, ClaimEntry]) -> int:
    return max(
        (d.time_slice.seq for e in journal.values() for d in e.devices if d.time_slice),
        default=0,
    )


def _gpus(devices: Sequence[PreparedDevice], *, applied_only: bool = False) -> list[str]:
    """The GPUs named by the devices' records, in order, each once."""
    out: list[str] = []
    for device in devices:
        record = device.time_slice
        if record is None or (applied_only and record.seq == 0):
            continue
        if record.gpu_uuid not in out:
            out.append(record.gpu_uuid)
    return out


class ClaimTimeSlices:
    """The time-slice side of prepare, unprepare and start. `ops` None: the backend
    sets nothing (and planning records nothing)."""

    def __init__(self, ops: TimeSliceOps | None) -> None:
        self._ops = ops
        self.enabled = ops is not None  # intervals are planned (what planning is told)
        self._last_seq = 0
        # GPUs a failed `apply` had already set, per claim, until a rollback restored them.
        self._unrestored: dict[str, list[str]] = {}

    def _set(self, gpu_uuid: str, interval: str) -> None:
        assert self._ops is not None
        try:
            self._ops.set(gpu_uuid, interval)
        except DriverError:
            raise
        except Exception as err:  # a bug in an implementation must not escape as one
            raise transient(
                f"cannot set the time-slice interval of GPU {gpu_uuid} to {interval}: {err}"
            ) from err
        log.info("time-slice interval of GPU %s set to %s", gpu_uuid, interval)

    # -- prepare -----------------------------------------------------------------------

    def apply(
        self, uid: str, planned: Sequence[PlannedDevice], journal: Mapping[str, ClaimEntry]
    ) -> tuple[PlannedDevice, ...]:
        """Set the claim's intervals (its `PrepareStarted` entry, the intent, is
        durable) and return its devices with their records stamped. Raises a
        transient error; a GPU whose call failed is taken to be unchanged, the ones
        set before it are put back by the rollback (`restore`)."""
        gpus = _gpus([p.prepared for p in planned])
        if not gpus or self._ops is None:
            return tuple(planned)
        seq = max(self._last_seq, _max_seq(journal)) + 1
        self._last_seq = seq
        done: list[str] = []
        try:
            for p in planned:
                record = p.prepared.time_slice
                if record is not None:
                    self._set(record.gpu_uuid, record.interval)
                    done.append(record.gpu_uuid)
        except DriverError:
            if done:
                self._unrestored[uid] = done
            raise
        return tuple(
            replace(p, prepared=replace(p.prepared, time_slice=replace(r, seq=seq)))
            if (r := p.prepared.time_slice) is not None
            else p
            for p in planned
        )

    def restore(
        self,
        uid: str,
        devices: Sequence[PreparedDevice],
        journal: Mapping[str, ClaimEntry],
        *,
        intent: bool = False,
    ) -> None:
        """Roll back the settings of claim `uid`: each GPU it set gets what the other
        completed claims want (`Default` if none). `intent`: the devices come from a
        journal entry of an earlier attempt or process, so every GPU they name may
        have been set; otherwise only those this process set. Raises a transient
        error (the caller keeps the entry)."""
        gpus = _gpus(devices, applied_only=not intent)
        gpus += [g for g in self._unrestored.get(uid, ()) if g not in gpus]
        if gpus and self._ops is not None:
            want = wanted(journal, exclude={uid})
            for gpu in gpus:
                self._set(gpu, want.get(gpu, DEFAULT))
        self._unrestored.pop(uid, None)

    # -- unprepare ---------------------------------------------------------------------

    def release(
        self, journal: Mapping[str, ClaimEntry], uids: Sequence[str]
    ) -> dict[str, DriverError]:
        """Before the entries of `uids` are dropped: each GPU they name gets what the
        remaining claims want, if that differs from what it runs with (always for a
        `PrepareStarted` entry: what its attempt did is unknown). Returns the claims
        whose GPU could not be set (they keep their entries)."""
        errors: dict[str, DriverError] = {}
        if self._ops is None:
            return errors
        leaving = {uid: journal[uid] for uid in uids if uid in journal}
        holders: dict[str, list[str]] = {}
        for uid, entry in leaving.items():
            for gpu in [*_gpus(entry.devices), *self._unrestored.get(uid, ())]:
                holders.setdefault(gpu, []).append(uid)
        before, after = wanted(journal), wanted(journal, exclude=leaving)
        for gpu, uids_on_gpu in holders.items():
            target = after.get(gpu, DEFAULT)
            unknown = any(
                leaving[u].state is not ClaimState.PREPARE_COMPLETED or u in self._unrestored
                for u in uids_on_gpu
            )
            if not unknown and before.get(gpu, DEFAULT) == target:
                continue  # another claim keeps the GPU at its interval
            try:
                self._set(gpu, target)
            except GpuLostError as err:  # a reset or a reboot, the only ways back, restore it
                log.warning("unprepare: the time-slice interval counts as restored: %s", err)
            except DriverError as err:
                log.error("unprepare: restoring the time-slice interval failed: %s", err)
                for u in uids_on_gpu:
                    errors.setdefault(u, err)
        for uid in leaving:
            if uid not in errors:
                self._unrestored.pop(uid, None)
        return errors

    # -- start -------------------------------------------------------------------------

    def reapply(self, journal: Mapping[str, ClaimEntry]) -> tuple[str, ...]:
        """At start: every GPU a completed claim holds gets its wanted interval again
        (a reboot reset it). A failure is logged; the claim stays prepared (the
        interval is a performance setting). Returns the GPUs set."""
        done: list[str] = []
        if self._ops is not None:
            for gpu, interval in sorted(wanted(journal).items()):
                try:
                    self._set(gpu, interval)
                    done.append(gpu)
                except DriverError as err:
                    log.error("re-applying the time-slice interval of a prepared claim: %s", err)
        return tuple(done)
