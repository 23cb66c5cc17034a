"""tests/gpu/containers.py: which of a claim's CDI mounts are the driver's libraries,
whose C libraries a container's CUDA client needs in its root filesystem (the MPS
container test, tests/gpu/test_mps_containers.py)."""

from __future__ import annotations

from pathlib import Path

from tests.gpu.containers import driver_libraries


def _mount(host: str, container: str) -> dict[str, str]:
    return {"hostPath": host, "containerPath": container}


def test_the_driver_libraries_are_the_mounted_libcuda_and_libnvidia_objects() -> None:
    lib = "/usr/local/nvidia/lib64"
    common = {
        "devices": [{"name": "common", "containerEdits": {}}],
        "containerEdits": {
            "mounts": [
                _mount(f"{lib}/libcuda.so.580.159.04", f"{lib}/libcuda.so.580.159.04"),
                _mount(f"{lib}/libnvidia-ml.so.580.159.04", f"{lib}/libnvidia-ml.so.580.159.04"),
                _mount("/usr/local/nvidia/bin/nvidia-smi", "/usr/bin/nvidia-smi"),
                _mount("/lib/firmware/nvidia/580.159.04/gsp_ga10x.bin", "/lib/firmware/x.bin"),
            ]
        },
    }
    claim = {
        "devices": [
            {
                "name": "c-gpu-0",
                "containerEdits": {"mounts": [_mount("/var/lib/x/mps/0/pipe", "/tmp/nvidia-mps")]},
            }
        ]
    }
    assert driver_libraries([claim, common]) == [
        Path(f"{lib}/libcuda.so.580.159.04"),
        Path(f"{lib}/libnvidia-ml.so.580.159.04"),
    ]
    assert driver_libraries([claim]) == []
