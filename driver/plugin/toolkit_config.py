"""Whether the NVIDIA Container Toolkit on the node hands GPUs to pods that merely ask.

With `accept-nvidia-visible-devices-envvar-when-unprivileged` true (the toolkit's
default) and the toolkit as containerd's default runtime, a pod without any claim
gets every GPU by setting `NVIDIA_VISIBLE_DEVICES=all`, bypassing DRA. The plugin
reads the toolkit's config under the driver root's mount once at start and says what
it found: a WARNING in the log, `nvidiaToolkit` and a note in /status, and
`gpu_dra_nvidia_toolkit_config{result}` (docs/security.md). It changes nothing.

Results: `hardened` (the key is false), `accepts-envvar` (true or unset),
`no-config` (no file there: the toolkit is not installed under this root, or keeps
its config elsewhere, as the GPU Operator does), `unreadable` (not TOML, the key not
a boolean, a symlink or no regular file; never followed, never opened blocking).
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from driver.fileio import read_file_nofollow
from driver.observability import metrics

log = logging.getLogger(__name__)

TOOLKIT_CONFIG: Final = Path("etc/nvidia-container-runtime/config.toml")
ENVVAR_KEY: Final = "accept-nvidia-visible-devices-envvar-when-unprivileged"
RESULTS: Final = ("accepts-envvar", "hardened", "no-config", "unreadable")


@dataclass(frozen=True)
class ToolkitCheck:
    result: str  # one of RESULTS
    path: Path
    detail: str = ""  # why a file is unreadable

    @property
    def warning(self) -> str | None:
        """What an operator should do about it, or None."""
        if self.result == "accepts-envvar":
            return (
                f"{self.path} does not set {ENVVAR_KEY} = false: where the NVIDIA "
                "Container Toolkit is the default runtime, a pod without a claim gets "
                "every GPU by setting NVIDIA_VISIBLE_DEVICES (docs/security.md)"
            )
        if self.result == "unreadable":
            return f"cannot tell whether {self.path} sets {ENVVAR_KEY} = false: {self.detail}"
        return None

    def to_json(self) -> dict[str, object]:
        return {"result": self.result, "path": str(self.path), "warning": self.warning}


def check_toolkit_config(driver_root: Path) -> ToolkitCheck:
    """What the toolkit's config under `driver_root` (the plugin's mount) says."""
    path = driver_root / TOOLKIT_CONFIG
    try:
        doc = tomllib.loads(read_file_nofollow(path).decode())
    except FileNotFoundError:
        return ToolkitCheck("no-config", path)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        return ToolkitCheck("unreadable", path, str(err))
    accepted = doc.get(ENVVAR_KEY, True)  # the toolkit's default
    if not isinstance(accepted, bool):
        return ToolkitCheck("unreadable", path, f"{ENVVAR_KEY} is not a boolean: {accepted!r}")
    return ToolkitCheck("accepts-envvar" if accepted else "hardened", path)


def report_toolkit_check(check: ToolkitCheck) -> None:
    """The log line and `gpu_dra_nvidia_toolkit_config`."""
    for result in RESULTS:
        metrics.NVIDIA_TOOLKIT_CONFIG.labels(result=result).set(float(result == check.result))
    if check.warning is not None:
        log.warning("%s", check.warning)
    elif check.result == "no-config":
        log.info("no NVIDIA Container Toolkit config at %s: not checked", check.path)
