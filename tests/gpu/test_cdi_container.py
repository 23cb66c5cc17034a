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
from pathlib import Path
from typing import Any

from driver.cdi.driver_edits import DriverRoot
from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import GpuInfo
from tests import cdi_bundle
from tests.gpu import containers
from tests.gpu.node import open_node


def test_a_container_with_exactly_the_claims_edits_lists_exactly_its_gpu(
    backend: NvmlBackend, whole_gpu: GpuInfo, tmp_path: Path, monkeypatch: Any
) -> None:
    tools = containers.cdi_tools()
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
    host_smi, container_smi = containers.mounted_binary(specs, "nvidia-smi")
    rootfs = tmp_path / "rootfs"
    containers.c_library_rootfs(rootfs, host_smi)
    proc = cdi_bundle.run(
        tmp_path / "bundle", rootfs, specs, result.devices[0].cdi_device_ids, [container_smi, "-L"]
    )
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    listed = [line for line in proc.stdout.splitlines() if line.startswith("GPU ")]
    assert len(listed) == 1 and gpu.uuid in listed[0], proc.stdout
    assert node.state.unprepare([ref]) == {"ctr": None}
