"""A container started with exactly a claim's CDI edits sees exactly its GPU.

A whole GPU is prepared through the real NVML path with the driver's files from the
host's driver root (gpu-dra-cdi-common, nvidia-cdi-hook from hack/build-nvidia-tools.sh);
runc then starts `nvidia-smi -L` in a root filesystem that holds only the C library
(no NVIDIA file of its own), with the claim's CDI devices applied as a CDI runtime
does (tests/cdi_bundle.py). It must list one GPU, the claimed one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from driver.nvml.backend import NvmlBackend
from driver.nvml.types import GpuInfo
from driver.state.driver_edits import DriverRoot
from tests import cdi_bundle
from tests.gpu.node import open_node

REPO = Path(__file__).resolve().parents[2]
LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")


def _tools() -> Path:
    proc = subprocess.run(
        ["bash", str(REPO / "hack/build-nvidia-tools.sh"), "path"],
        capture_output=True,
        text=True,
        check=False,
    )
    tools = Path(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else Path()
    missing = [n for n in ("gpu-dra-cdi-common", "nvidia-cdi-hook") if not (tools / n).is_file()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing in {tools}: run hack/build-nvidia-tools.sh")
    return tools


def _mounted_binary(specs: list[dict[str, Any]], name: str) -> tuple[Path, str]:
    """Where the specs mount the driver's binary `name`: its host path and the path the
    container sees (a driver root such as /usr/local/nvidia keeps its own layout)."""
    for spec in specs:
        edits = [spec.get("containerEdits", {})]
        edits += [device["containerEdits"] for device in spec.get("devices", [])]
        for mount in (m for e in edits for m in e.get("mounts", [])):
            if Path(mount["containerPath"]).name == name:
                return Path(mount["hostPath"]), mount["containerPath"]
    pytest.fail(f"the claim's CDI specs mount no {name}")


def _c_library_rootfs(rootfs: Path, program: Path) -> None:
    """The loader and C libraries `program` links, none of NVIDIA's, in /lib."""
    out = subprocess.run(["ldd", str(program)], capture_output=True, text=True, check=True)
    (rootfs / "lib").mkdir(parents=True)
    (rootfs / "lib64").symlink_to("lib")
    for d in ("etc", "usr/bin", "usr/lib/x86_64-linux-gnu", "dev", "proc", "sys", "tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for match in LDD_LINE.finditer(out.stdout):
        library = Path(match.group(1))
        if not library.name.startswith(("libnvidia", "libcuda")):
            shutil.copy2(library.resolve(), rootfs / "lib" / library.name)


def test_a_container_with_exactly_the_claims_edits_lists_exactly_its_gpu(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path, monkeypatch: Any
) -> None:
    tools = _tools()
    monkeypatch.setenv("PATH", f"{tools}:{os.environ.get('PATH', '')}")
    root = Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/")
    driver = DriverRoot(root, root, str(tools / "nvidia-cdi-hook"))
    node = open_node(backend, tmp_path, driver_root=driver)
    gpu = whole_gpu
    ref = node.claims.add("ctr", f"gpu-{gpu.minor}")
    result = node.state.prepare([ref])["ctr"]
    assert result.ok, result.error
    specs: list[dict[str, Any]] = [node.spec("ctr")]
    specs.append(json.loads(node.state.cdi.common_spec_path.read_text()))
    host_smi, container_smi = _mounted_binary(specs, "nvidia-smi")
    rootfs = tmp_path / "rootfs"
    _c_library_rootfs(rootfs, host_smi)
    proc = cdi_bundle.run(
        tmp_path / "bundle", rootfs, specs, result.devices[0].cdi_device_ids, [container_smi, "-L"]
    )
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    listed = [line for line in proc.stdout.splitlines() if line.startswith("GPU ")]
    assert len(listed) == 1 and gpu.uuid in listed[0], proc.stdout
    assert node.state.unprepare([ref]) == {"ctr": None}
