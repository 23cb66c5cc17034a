"""The character device nodes a container needs for a GPU or MIG device, complete:
type `c`, major, minor and file mode, so the container runtime creates them in the
container and allows them in its device cgroup without looking for them on the host.

Majors come from the kernel's `/proc/devices` (the NVIDIA driver registers `nvidia`
— `nvidia-frontend` before driver 550 — for `/dev/nvidia<N>`, `/dev/nvidiactl` and
`/dev/nvidia-modeset`; `nvidia-uvm` for `/dev/nvidia-uvm` and `/dev/nvidia-uvm-tools`;
`nvidia-caps` for the MIG capability nodes). Minors of the fixed nodes are the
driver's constants; a GPU's is its NVML minor number; a MIG capability's is in its
`/proc/driver/nvidia/capabilities/.../access` file (driver/nvml/mig/caps.py). The NVIDIA
driver creates its nodes world read-write (0666); capability nodes take the mode
their access file gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from driver.nvml.mig.caps import CAPS_DEVICE_DIR, CapabilityNode

GPU_MAJOR_NAMES: Final = ("nvidia", "nvidia-frontend")
UVM_MAJOR_NAME: Final = "nvidia-uvm"
CAPS_MAJOR_NAME: Final = "nvidia-caps"
NVIDIA_NODE_MODE: Final = 0o666

CTL_MINOR: Final = 255
MODESET_MINOR: Final = 254
UVM_MINOR: Final = 0
UVM_TOOLS_MINOR: Final = 1


class DeviceNodeError(RuntimeError):
    """A device node's major is unknown (the kernel module is not loaded)."""


@dataclass(frozen=True)
class DeviceNode:
    """One CDI `deviceNodes` entry. `major` None: a path-only node as journals of
    earlier releases hold them (the runtime then reads type and numbers on the host)."""

    path: str
    major: int | None = None
    minor: int | None = None
    file_mode: int | None = None

    def to_json(self) -> dict[str, Any]:
        if self.major is None or self.minor is None:
            return {"path": self.path}
        doc: dict[str, Any] = {"path": self.path, "type": "c", "major": self.major}
        doc["minor"] = self.minor
        if self.file_mode is not None:
            doc["fileMode"] = self.file_mode
        return doc

    @classmethod
    def from_json(cls, doc: object) -> DeviceNode:
        """A CDI node object, or a bare path string (the journal's older form)."""
        if isinstance(doc, str):
            return cls(doc)
        if not isinstance(doc, Mapping) or not isinstance(doc.get("path"), str):
            raise ValueError("a device node must be a path or an object with a string path")
        numbers = [doc.get(k) for k in ("major", "minor", "fileMode")]
        if not all(n is None or (isinstance(n, int) and not isinstance(n, bool)) for n in numbers):
            raise ValueError(f"device node {doc['path']}: major, minor, fileMode must be integers")
        if doc.get("type", "c") != "c":
            raise ValueError(f"device node {doc['path']}: type must be c")
        major, minor, mode = numbers
        return cls(doc["path"], major, minor, mode)


@dataclass(frozen=True)
class CharMajors:
    """The majors of the NVIDIA character devices the kernel registered."""

    gpu: int | None = None
    uvm: int | None = None
    caps: int | None = None

    @classmethod
    def parse(cls, proc_devices: str) -> CharMajors:
        """From the text of `/proc/devices` (its "Character devices:" section only)."""
        majors: dict[str, int] = {}
        in_char = False
        for line in proc_devices.splitlines():
            if line.strip().endswith("devices:"):
                in_char = line.strip() == "Character devices:"
                continue
            number, _, name = line.strip().partition(" ")
            if in_char and number.isdigit() and name:
                majors.setdefault(name.strip(), int(number))
        gpu = next((majors[n] for n in GPU_MAJOR_NAMES if n in majors), None)
        return cls(gpu=gpu, uvm=majors.get(UVM_MAJOR_NAME), caps=majors.get(CAPS_MAJOR_NAME))

    @classmethod
    def read(cls, path: Path = Path("/proc/devices")) -> CharMajors:
        return cls.parse(path.read_text())

    def _need(self, major: int | None, name: str, node: str) -> int:
        if major is None:
            raise DeviceNodeError(
                f"{node}: no '{name}' character device in /proc/devices "
                "(is the NVIDIA kernel module loaded?)"
            )
        return major

    def gpu_node(self, minor: int) -> DeviceNode:
        path = f"/dev/nvidia{minor}"
        major = self._need(self.gpu, GPU_MAJOR_NAMES[0], path)
        return DeviceNode(path, major, minor, NVIDIA_NODE_MODE)

    def capability_node(self, cap: CapabilityNode) -> DeviceNode:
        path = f"{CAPS_DEVICE_DIR}/nvidia-cap{cap.minor}"
        return DeviceNode(path, self._need(self.caps, CAPS_MAJOR_NAME, path), cap.minor, cap.mode)

    def control_nodes(self, *, modeset: bool) -> tuple[DeviceNode, ...]:
        """`/dev/nvidiactl` and the UVM nodes CUDA opens (and `/dev/nvidia-modeset`
        where the host has it, as NVIDIA's generator includes it then). UVM nodes are
        left out while the `nvidia-uvm` module is not loaded (CUDA loads it on first use
        on the host through nvidia-modprobe; the next start of the plugin adds them)."""
        ctl = self._need(self.gpu, GPU_MAJOR_NAMES[0], "/dev/nvidiactl")
        nodes = [DeviceNode("/dev/nvidiactl", ctl, CTL_MINOR, NVIDIA_NODE_MODE)]
        if modeset:
            nodes.append(DeviceNode("/dev/nvidia-modeset", ctl, MODESET_MINOR, NVIDIA_NODE_MODE))
        if self.uvm is not None:
            nodes.append(DeviceNode("/dev/nvidia-uvm", self.uvm, UVM_MINOR, NVIDIA_NODE_MODE))
            nodes.append(
                DeviceNode("/dev/nvidia-uvm-tools", self.uvm, UVM_TOOLS_MINOR, NVIDIA_NODE_MODE)
            )
        return tuple(nodes)
