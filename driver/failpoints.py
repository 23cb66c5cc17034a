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

# In the order they are passed on the happy path; what each one leaves is in
# docs/state.md, "Failpoints". Prepare and unprepare work on the whole request (a batch
# of claims) at once, so each failpoint is passed at most once per call and a crash
# leaves every claim of the batch at the same step.
PREPARE_FAILPOINTS: Final[tuple[str, ...]] = (
    "prepare-rollback-after-cdi-removed",
    "prepare-before-started",
    "prepare-started-before-commit",
    "prepare-after-started",
    "prepare-before-mig-create",
    "prepare-after-mig-create",
    "prepare-cdi-before-rename",
    "prepare-after-cdi",
    "prepare-completed-before-commit",
    "prepare-after-completed",
)

UNPREPARE_FAILPOINTS: Final[tuple[str, ...]] = (
    "unprepare-before-cdi-removed",
    "unprepare-after-cdi-removed",
    "unprepare-before-mig-destroy",
    "unprepare-after-mig-destroy",
    "unprepare-entry-before-commit",
    "unprepare-after-entry-removed",
)

FAILPOINTS: Final[tuple[str, ...]] = PREPARE_FAILPOINTS + UNPREPARE_FAILPOINTS
_KNOWN: Final = frozenset(FAILPOINTS)


def failpoint(name: str) -> None:
    """SIGKILL this process if the environment arms `name`; otherwise do nothing."""
    if name not in _KNOWN:
        raise ValueError(f"unknown failpoint {name!r}; add it to driver.failpoints")
    armed = os.environ.get(ENV_VAR)
    if armed and name in {part.strip() for part in armed.split(",")}:
        os.kill(os.getpid(), signal.SIGKILL)
