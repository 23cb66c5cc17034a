"""The container edits every GPU container needs besides its device nodes: the NVIDIA
driver's libraries, binaries, firmware and IPC sockets as mounts, and the
`nvidia-cdi-hook` hooks (symlinks, ld cache, ...), exactly as NVIDIA's generator makes
them for the node's driver root.

They come from `gpu-dra-cdi-common` (cmd/gpu-dra-cdi-common, shipped in the image): it
calls the NVIDIA Container Toolkit's `nvcdi` library as NVIDIA's own DRA driver does
(`GetCommonEdits` in nvml mode, the driver version read from the driver root's
`libcuda.so.<version>`) and rewrites the container's view of the driver root to the
host's, which is what the runtime reads. They go into the common CDI spec, written at
start and again when the driver root holds another driver version (an upgrade of the
GPU Operator's driver container does not restart this plugin).

The generator's own device nodes are left out: the control nodes are written complete
(type, major, minor, mode) from /proc/devices instead (driver/cdi/device_nodes.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

GENERATOR: Final = "gpu-dra-cdi-common"
LIBCUDA_DIR_ENV: Final = "NVIDIA_CTK_LIBCUDA_DIR"
GENERATOR_TIMEOUT_SECONDS: Final = 60.0
EDIT_KEYS: Final = ("env", "mounts", "hooks")


class DriverEditsError(RuntimeError):
    """The driver's edits could not be generated; one line naming the cause."""


@dataclass(frozen=True)
class DriverRoot:
    """Where the NVIDIA driver is: `path` as this process sees it, `host_path` as the
    container runtime on the host does (the CDI spec must name host paths)."""

    path: Path
    host_path: Path
    hook_path: str  # nvidia-cdi-hook on the host


@dataclass(frozen=True)
class DriverEdits:
    """The generator's answer: the driver version it found and the CDI edits (env,
    mounts, hooks; never device nodes)."""

    driver_version: str
    edits: Mapping[str, Any] = field(default_factory=dict)

    def libcuda_paths(self, root: DriverRoot) -> list[Path]:
        """Where `libcuda.so.<version>` is in this process's view of the driver root,
        one path per library directory the generator found."""
        prefix = f"{LIBCUDA_DIR_ENV}="
        env = self.edits.get("env", [])
        dirs = next((e.removeprefix(prefix) for e in env if e.startswith(prefix)), "")
        host = str(root.host_path).rstrip("/")
        out = []
        for directory in filter(None, dirs.split(os.pathsep)):
            relative = directory[len(host) :] if host and directory.startswith(host) else directory
            out.append(root.path / relative.lstrip("/") / f"libcuda.so.{self.driver_version}")
        return out

    def is_current(self, root: DriverRoot) -> bool:
        """The driver root still holds this driver version (one stat per library dir)."""
        paths = self.libcuda_paths(root)
        return bool(paths) and all(p.exists() for p in paths)


def parse_generator_output(raw: str | bytes) -> DriverEdits:
    try:
        doc = json.loads(raw)
    except ValueError as err:
        raise DriverEditsError(f"{GENERATOR} printed no JSON: {err}") from err
    if not isinstance(doc, dict):
        raise DriverEditsError(f"{GENERATOR} printed {type(doc).__name__}, not an object")
    version, edits = doc.get("driverVersion"), doc.get("containerEdits")
    if not isinstance(version, str) or not version:
        raise DriverEditsError(f"{GENERATOR}: no driverVersion in its output")
    if not isinstance(edits, dict):
        raise DriverEditsError(f"{GENERATOR}: containerEdits must be an object")
    kept = {key: edits[key] for key in EDIT_KEYS if edits.get(key)}
    for key, value in kept.items():
        if not isinstance(value, list):
            raise DriverEditsError(f"{GENERATOR}: containerEdits.{key} must be a list")
    return DriverEdits(version, kept)


def generate(root: DriverRoot, generator: Path | None = None) -> DriverEdits:
    """Run the generator for the driver root. Raises DriverEditsError."""
    found = generator or shutil.which(GENERATOR)
    if found is None:
        raise DriverEditsError(f"{GENERATOR} is not on PATH (it ships in the driver's image)")
    command = [
        str(found),
        "--driver-root",
        str(root.path),
        "--target-driver-root",
        str(root.host_path),
        "--nvidia-cdi-hook-path",
        root.hook_path,
    ]
    try:
        done = subprocess.run(
            command, capture_output=True, timeout=GENERATOR_TIMEOUT_SECONDS, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DriverEditsError(f"{GENERATOR} for driver root {root.path}: {err}") from err
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise DriverEditsError(f"{GENERATOR} for driver root {root.path}: {why}")
    return parse_generator_output(done.stdout)
