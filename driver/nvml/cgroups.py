"""Where a process NVML lists runs: its cgroup, from `/proc/<pid>/cgroup`, and the pod
UID the kubelet put in that path.

The kubelet names a pod's cgroup after its UID, with either cgroup driver:
`kubepods-besteffort-pod<uid with _ for ->.slice` (systemd) or `pod<uid>` (cgroupfs),
and the runtime puts each container's cgroup below it. `/proc/<pid>/cgroup` names the
process's cgroups relative to the cgroup root as seen from the reader's cgroup
namespace: the plugin reads the host's with the host's `/proc` (its process in the
host's PID namespace); a pid from another PID namespace is not there (None).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

DEFAULT_PROC_ROOT: Final = Path("/proc")
DEFAULT_CGROUP_ROOT: Final = Path("/sys/fs/cgroup")

_POD_UID = re.compile(
    r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
)


def _lines(proc_root: Path | str, pid: int) -> list[str]:
    try:
        text = (Path(proc_root) / str(pid) / "cgroup").read_text()
    except (OSError, ValueError):  # gone, another PID namespace, not readable
        return []
    return text.splitlines()


def process_cgroup(proc_root: Path | str, pid: int) -> str | None:
    """The process's cgroup v2 path (`/kubepods.slice/...`, the `0::` line), or None."""
    for line in _lines(proc_root, pid):
        if line.startswith("0::"):
            return line[3:] or "/"
    return None


def pod_uid(cgroup_path: str) -> str | None:
    """The UID of the pod whose cgroup `cgroup_path` is in (or below), or None."""
    found = _POD_UID.findall(cgroup_path)
    return found[-1].replace("_", "-") if found else None


def process_pod_uid(proc_root: Path | str, pid: int) -> str | None:
    """The UID of the pod the process runs in, from any of its cgroup lines (cgroup v1
    and v2 name the same pod), or None (not a pod's process, or not seen here)."""
    for line in _lines(proc_root, pid):
        uid = pod_uid(line.split(":", 2)[-1])
        if uid is not None:
            return uid
    return None


def cgroup_dir(cgroup_root: Path | str, cgroup_path: str) -> Path:
    """The directory of a cgroup v2 path under the cgroup filesystem's mount."""
    return Path(cgroup_root) / cgroup_path.lstrip("/")
