"""Loading libnvidia-ml from the driver root the chart mounts (NVIDIA_DRIVER_ROOT)."""

from __future__ import annotations

import ctypes.util
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from driver.nvml.library import NVML_LIBRARY, NvmlUnavailableError, load_library_from_driver_root


@pytest.mark.parametrize(
    "layout",
    [
        "usr/lib64",
        "usr/lib/x86_64-linux-gnu",
        "lib64",  # GKE's driver installer: /home/kubernetes/bin/nvidia/lib64
    ],
)
def test_library_under_the_driver_root_is_loaded(tmp_path: Path, layout: str) -> None:
    some_shared_library = ctypes.util.find_library("m")
    assert some_shared_library, "libm is part of every glibc install"
    libdir = tmp_path / layout
    libdir.mkdir(parents=True)
    source = next(
        Path(p)
        for p in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")
        if (Path(p) / some_shared_library).exists()
    )
    shutil.copy(source / some_shared_library, libdir / NVML_LIBRARY)
    fake_pynvml = SimpleNamespace(nvmlLib=None)
    load_library_from_driver_root(fake_pynvml, str(tmp_path))
    assert isinstance(fake_pynvml.nvmlLib, ctypes.CDLL)
    assert fake_pynvml.nvmlLib._name == str(libdir / NVML_LIBRARY)


def test_missing_library_names_the_driver_root(tmp_path: Path) -> None:
    with pytest.raises(
        NvmlUnavailableError, match=rf"NVIDIA_DRIVER_ROOT\) {tmp_path}: no {NVML_LIBRARY}"
    ):
        load_library_from_driver_root(SimpleNamespace(nvmlLib=None), str(tmp_path))


@pytest.mark.parametrize("root", ["", "/"])
def test_host_root_leaves_the_loader_alone(root: str) -> None:
    fake_pynvml = SimpleNamespace(nvmlLib=None)
    load_library_from_driver_root(fake_pynvml, root)
    assert fake_pynvml.nvmlLib is None
