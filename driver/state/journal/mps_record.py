"""The journal's record of a prepared device's MPS control daemon
(`PreparedDevice.mps`, key `mps`; docs/mps.md). `computeModeBefore`, on a whole GPU
whose one daemon holds it in EXCLUSIVE_PROCESS (docs/mps.md, "Strict: one MPS server,
EXCLUSIVE_PROCESS"), is the compute mode the GPU had before; an entry without it
(cooperative, or written by an earlier release) leaves the mode alone. `shared`: the
daemon is its GPU's one server for every strict partition claim of the GPU."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _optional_int(doc: Mapping[str, Any], key: str, low: int) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"mps.{key} must be an integer >= {low}")
    return value


def _deployment(doc: object) -> tuple[str, str, str, int]:
    if doc is None:
        return "", "", "", 0
    if not isinstance(doc, Mapping):
        raise ValueError("mps.deployment must be an object")
    name, uid, pod = doc.get("name"), doc.get("uid", ""), doc.get("pod", "")
    if not isinstance(name, str) or not name:
        raise ValueError("mps.deployment.name must be a Deployment name")
    if not isinstance(uid, str):
        raise ValueError("mps.deployment.uid must be a string")
    if not isinstance(pod, str):
        raise ValueError("mps.deployment.pod must be a string")
    restarts = _optional_int(doc, "restarts", 0) or 0
    return name, uid, pod, restarts


@dataclass(frozen=True)
class MpsRecord:
    """A device's own daemon: its GPU, the limits it gives its clients, the name of
    its directory under the plugin's MPS root, and the daemon once started (`pid` 0
    in the intent, before it is)."""

    gpu_uuid: str
    directory: str
    active_thread_percentage: int | None = None
    pinned_memory_bytes: int | None = None
    pid: int = 0
    start_time: int = 0
    # Under Kubernetes (--mps-daemons=kubernetes) the daemon runs in a Deployment of
    # its own instead (driver/kube/mps_daemons.py): its name from the intent on, its
    # UID once created.
    deployment: str = ""
    deployment_uid: str = ""
    # Its pod as last seen (UID, its container's restarts): one replaced or restarted
    # since is a daemon lost (driver/state/mps_watch.py). Empty: not seen yet.
    pod_uid: str = ""
    pod_restarts: int = 0
    # Strict (driver/state/mps/compute_modes.py): the GPU's compute mode (NVML's
    # number) before the claim set EXCLUSIVE_PROCESS, read before the intent is
    # stored, put back when the daemon goes. None: cooperative, the mode is left alone.
    compute_mode_before: int | None = None
    # The GPU's one server, shared by every strict partition claim of the GPU
    # (driver/state/mps/shared.py): its directory is the GPU's, not the device's, its
    # limits the partition's; it stops, and the mode goes back, with the last claim.
    shared: bool = False

    @property
    def strict(self) -> bool:
        """Does the claim hold its GPU in EXCLUSIVE_PROCESS?"""
        return self.compute_mode_before is not None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"gpu": self.gpu_uuid, "dir": self.directory}
        if self.active_thread_percentage is not None:
            doc["threads"] = self.active_thread_percentage
        if self.pinned_memory_bytes is not None:
            doc["memory"] = self.pinned_memory_bytes
        doc["pid"], doc["start"] = self.pid, self.start_time
        if self.deployment:
            deployment: dict[str, Any] = {"name": self.deployment, "uid": self.deployment_uid}
            if self.pod_uid:
                deployment.update(pod=self.pod_uid, restarts=self.pod_restarts)
            doc["deployment"] = deployment
        if self.compute_mode_before is not None:
            doc["computeModeBefore"] = self.compute_mode_before
        if self.shared:
            doc["shared"] = True
        return doc

    @classmethod
    def from_json(cls, doc: object) -> MpsRecord:
        if not isinstance(doc, Mapping):
            raise ValueError("mps must be an object")
        gpu, directory = doc.get("gpu"), doc.get("dir")
        if not isinstance(gpu, str) or not gpu:
            raise ValueError("mps.gpu must be a GPU UUID")
        if not isinstance(directory, str) or not directory or "/" in directory:
            raise ValueError("mps.dir must be a directory name")
        name, uid, pod, restarts = _deployment(doc.get("deployment"))
        shared = doc.get("shared", False)
        if not isinstance(shared, bool):
            raise ValueError("mps.shared must be a boolean")
        return cls(
            gpu,
            directory,
            _optional_int(doc, "threads", 1),
            _optional_int(doc, "memory", 1),
            _optional_int(doc, "pid", 0) or 0,
            _optional_int(doc, "start", 0) or 0,
            name,
            uid,
            pod,
            restarts,
            _optional_int(doc, "computeModeBefore", 0),
            shared,
        )
