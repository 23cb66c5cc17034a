"""Setting a GPU's time-slice interval with the driver root's `nvidia-smi`, as NVIDIA's
DRA driver does (cmd/gpu-kubelet-plugin/nvlib.go, `setTimeSlice`):

    nvidia-smi compute-policy -i <GPU UUID> --set-timeslice <0|1|2|3>

Default=0, Short=1, Medium=2, Long=3 (their `TimeSliceInterval.Int`). NVML has no
call for it. The binary is looked up under the driver root the plugin sees
(`--nvidia-driver-root`, e.g. /driver-root) when first needed, in NVIDIA's order
(opt/bin, usr/bin, usr/sbin, bin, sbin), and runs with the driver root's
libnvidia-ml preloaded (the container's loader does not search the driver root).
Every call has a timeout. A failure is a transient `DriverError` naming the GPU and
nvidia-smi's last error line. `Default` on a GPU that does not support the setting
(exit status 3, "not available on target device") succeeds: there is nothing to
restore there. A GPU that has fallen off the bus (exit status 15) fails with
`GpuLostError`: a prepare fails transiently (the health monitor taints the GPU), and
a restore of that GPU counts as done (a GPU reset or a reboot, the only ways back,
restore `Default`).
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Final

from driver.errors import DriverError, ErrorClass, transient
from driver.nvml.library import LIBRARY_DIRS, NVML_LIBRARY

log = logging.getLogger(__name__)

INTERVAL_CODES: Final = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
BINARY: Final = "nvidia-smi"
BINARY_DIRS: Final = ("opt/bin", "usr/bin", "usr/sbin", "bin", "sbin")
DEFAULT_TIMEOUT: Final = 30.0
EXIT_NOT_SUPPORTED: Final = 3  # nvidia-smi: "the requested operation is not available"
EXIT_GPU_LOST: Final = 15  # nvidia-smi: "GPU has fallen off the bus or ... inaccessible"


class GpuLostError(DriverError):
    """The GPU cannot be reached to set its interval: it has fallen off the bus.
    Transient for the claim being prepared; the end of a restore obligation."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorClass.TRANSIENT, message)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class NvidiaSmiTimeSlice:
    """`TimeSliceOps` (driver/state/claim_timeslices.py) on real GPUs."""

    def __init__(self, driver_root: Path | str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.driver_root = Path(driver_root)
        self.timeout = timeout

    def binary(self) -> Path:
        for directory in BINARY_DIRS:
            candidate = self.driver_root / directory / BINARY
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        raise transient(
            f"no executable {BINARY} under the driver root {self.driver_root} (looked in "
            + ", ".join(BINARY_DIRS)
            + "); it sets GPU time-slice intervals"
        )

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        for directory in LIBRARY_DIRS:
            library = self.driver_root / directory / NVML_LIBRARY
            if library.exists():
                preload = env.get("LD_PRELOAD")
                env["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
                break
        return env

    def command(self, gpu_uuid: str, interval: str) -> list[str]:
        if interval not in INTERVAL_CODES:
            raise ValueError(f"unknown time-slice interval {interval!r}")
        code = INTERVAL_CODES[interval]
        return [str(self.binary()), "compute-policy", "-i", gpu_uuid, "--set-timeslice", str(code)]

    def set(self, gpu_uuid: str, interval: str) -> None:
        argv = self.command(gpu_uuid, interval)
        what = f"cannot set the time-slice interval of GPU {gpu_uuid} to {interval}"
        try:
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=self.timeout,
                env=self._env(),
                check=False,
            )
        except subprocess.TimeoutExpired as err:
            raise transient(f"{what}: {argv[0]} did not finish in {self.timeout:g}s") from err
        except OSError as err:
            raise transient(f"{what}: cannot run {argv[0]}: {err}") from err
        if proc.returncode == 0:
            return
        line = _last_line(proc.stderr) or _last_line(proc.stdout)
        if proc.returncode == EXIT_NOT_SUPPORTED and interval == "Default":
            log.warning("GPU %s has no time-slice setting to restore: %s", gpu_uuid, line)
            return
        failure = f"{what}: {argv[0]} exited with status {proc.returncode}: {line or '(no output)'}"
        if proc.returncode == EXIT_GPU_LOST:
            raise GpuLostError(failure)
        raise transient(failure)
