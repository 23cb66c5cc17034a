"""How long the mock's GPU-instance create and destroy take.

On a real H100 `nvmlDeviceCreateGpuInstanceWithPlacement` and `nvmlGpuInstanceDestroy`
take hundreds of milliseconds to seconds; the mock's take microseconds, which hides
what the driver holds while they run. Tests and benchmarks make them slow with
`MockNvml.mig_latency` (seconds) or, for a whole plugin process, the environment
variable `GPU_DRA_MOCK_MIG_LATENCY_MS`. The default is no delay.
"""

from __future__ import annotations

import math
import os
from typing import Final

LATENCY_ENV: Final = "GPU_DRA_MOCK_MIG_LATENCY_MS"


def latency_from_env() -> float:
    """Seconds from `GPU_DRA_MOCK_MIG_LATENCY_MS` (milliseconds; unset or empty: 0).
    ValueError naming the variable for anything but a finite number >= 0."""
    raw = os.environ.get(LATENCY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        millis = float(raw)
    except ValueError:
        raise ValueError(f"{LATENCY_ENV}={raw!r}: not a number of milliseconds") from None
    if not math.isfinite(millis) or millis < 0:
        raise ValueError(f"{LATENCY_ENV}={raw!r}: must be a finite number >= 0")
    return millis / 1000.0
