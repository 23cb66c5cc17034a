"""What the plugin's next start does with a journal entry, in one line: kept, rolled
back, adopted, restored, or its teardown finished. `gpu-dra journal show` prints it
for every entry and `gpu-dra journal quarantine` for every entry it carries over,
before the operator confirms. Told from the files alone (no NVML): where the outcome
depends on what is live on the GPU, the line says on what."""

from __future__ import annotations

from driver.state.journal.checkpoint import ClaimEntry, ClaimState

ROLLED_BACK = "rolled back: its CDI spec removed"
ROLLED_BACK_MIG = ROLLED_BACK + ", its MIG devices destroyed"
ADOPT_CONDITIONS = (
    "its MIG device is live at its placement (created by its attempt, with a compute "
    "instance) and its CDI spec names it"
)


def next_start(entry: ClaimEntry, spec_present: bool | None, boot: str) -> str:
    """`spec_present`: is the claim's CDI spec on disk (None: not known, no CDI root
    given); `boot`: this boot's id."""
    owns_mig = any(d.owns_mig for d in entry.devices)
    if entry.state is ClaimState.PREPARE_STARTED:
        rolled_back = ROLLED_BACK_MIG if owns_mig else ROLLED_BACK
        if not entry.adopt or not _adoptable(entry):
            return rolled_back
        if spec_present is False:
            return f"{rolled_back} (to be adopted, but its CDI spec is gone)"
        spec = "its CDI spec is in place, " if spec_present is None else ""
        return (
            f"adopted if {spec}{ADOPT_CONDITIONS}: kept as prepared, with the ids and UUID "
            f"of that device; otherwise {rolled_back}"
        )
    if entry.unpreparing is not None and entry.unpreparing == boot:
        teardown = "teardown finished: its MIG devices destroyed, its entry dropped"
        if spec_present is False:
            return teardown + " (its unprepare had begun)"
        if spec_present is None:
            return f"{teardown}, if its CDI spec is gone (its unprepare had begun); else kept"
    if spec_present is False:
        if entry.cdi_spec is None:
            return "kept; its lost CDI spec is redone by the claim's next prepare"
        restored = " and its MIG devices recreated where a reboot destroyed them"
        return f"restored: its CDI spec rewritten{restored if owns_mig else ''}"
    if owns_mig:
        return "kept (its MIG devices recreated at their placement if they are gone)"
    return "kept"


def _adoptable(entry: ClaimEntry) -> bool:
    """Can the entry's shape be adopted at all (driver/state/recovery/adoption.py)? Every MIG
    device it owns an intent that recorded what was there before it, and no
    time-slice interval."""
    for device in entry.devices:
        if device.time_slice is not None:
            return False
        record = device.mig
        if record is None or not record.owned:
            continue
        if record.gi_id is not None or record.before is None:
            return False
    return True
