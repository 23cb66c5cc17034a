"""Crash failpoints for the prepare/unprepare paths (docs/state.md, "Failpoints").

`failpoint(name)` kills the current process with SIGKILL when the environment
variable `GPU_DRA_FAILPOINTS` (a comma-separated list) names it, so tests can
crash the plugin between any two steps and check what a restart finds.
With the variable unset a failpoint costs one dictionary lookup.

Every name used in the code is listed in `FAILPOINTS`; using an unlisted name is
a programming error (ValueError), so the list, the docs and the crash tests (which
parametrize over `FAILPOINTS`) cannot drift apart.
"""

from __future__ import annotations

import os
import signal
from typing import Final

ENV_VAR: Final = "GPU_DRA_FAILPOINTS"

# In the order they are passed on the happy path. Prepare and unprepare work on the
# whole request (a batch of claims) at once, so each failpoint is passed at most once
# per call and a crash leaves every claim of the batch at the same step.
PREPARE_FAILPOINTS: Final[tuple[str, ...]] = (
    # entries were found for claims being prepared (a retried half-done prepare, or
    # recover() at startup): their CDI specs have been removed, the entries not yet
    # rewritten
    "prepare-rollback-after-cdi-removed",
    # all claims checked and planned, nothing written yet
    "prepare-before-started",
    # the journal store of the batch's PrepareStarted entries is encoded, not yet
    # committed: nothing of it appended to the log (nor the snapshot renamed, for a
    # store that writes one); only a batch that creates MIG devices or sets intervals
    # journals one
    "prepare-started-before-commit",
    # the PrepareStarted entries are durable, no CDI spec yet (idem)
    "prepare-after-started",
    # a MIG device of the batch is about to be created (its intent is journaled)
    "prepare-before-mig-create",
    # the batch's first MIG device exists (GPU and compute instance), not journaled
    # beyond its intent
    "prepare-after-mig-create",
    # the batch's first CDI spec temp file written, not renamed
    "prepare-cdi-before-rename",
    # every CDI spec in place (not fsynced: derived from the journal), the checkpoint
    # says PrepareStarted, or nothing for a batch without an intent
    "prepare-after-cdi",
    # the journal store of the PrepareCompleted entries is encoded, not yet committed
    "prepare-completed-before-commit",
    # PrepareCompleted is durable, the answer has not reached the kubelet
    "prepare-after-completed",
)

UNPREPARE_FAILPOINTS: Final[tuple[str, ...]] = (
    # entries/specs found for the batch, nothing removed yet (entries with MIG devices
    # the driver created are already marked `unpreparing`)
    "unprepare-before-cdi-removed",
    # the batch's CDI specs removed (not durably), checkpoint entries present
    "unprepare-after-cdi-removed",
    # an owned MIG device of the batch is about to be destroyed
    "unprepare-before-mig-destroy",
    # the batch's first owned MIG device is destroyed, entries present
    "unprepare-after-mig-destroy",
    # the journal store without the batch's entries is encoded, not yet committed
    "unprepare-entry-before-commit",
    # entries removed durably, the answer has not reached the kubelet
    "unprepare-after-entry-removed",
)

FAILPOINTS: Final[tuple[str, ...]] = PREPARE_FAILPOINTS + UNPREPARE_FAILPOINTS
_KNOWN: Final = frozenset(FAILPOINTS)


def armed() -> frozenset[str]:
    """The failpoint names currently named by the environment."""
    raw = os.environ.get(ENV_VAR, "")
    return frozenset(part.strip() for part in raw.split(",") if part.strip())


def failpoint(name: str) -> None:
    """SIGKILL this process if `name` is armed; otherwise do nothing."""
    if name not in _KNOWN:
        raise ValueError(f"unknown failpoint {name!r}; add it to driver.failpoints")
    if ENV_VAR in os.environ and name in armed():
        os.kill(os.getpid(), signal.SIGKILL)
