"""Which NVML backend a process runs on: real pynvml, loaded from the driver root, or
(explicitly chosen) the mock fleet. This is the only way to the mock
(`driver.nvml.mock`): with `mock=False` nothing of it is imported."""

from __future__ import annotations

import os
from pathlib import Path

from driver.nvml.backend import NvmlBackend
from driver.nvml.library import NvmlUnavailableError, load_library_from_driver_root


def check_mock_fleet(fleet_path: str | Path | None) -> None:
    """ValueError where the mock fleet (a YAML file or a built-in name) cannot be
    loaded: the plugin's settings check it before anything touches the host."""
    from driver.nvml.mock.fleet import resolve_fleet

    resolve_fleet(fleet_path)


def select_backend(
    *,
    mock: bool,
    fleet_path: str | Path | None = None,
    node_name: str = "",
    mock_driver_root: Path | None = None,
    driver_root: Path | str | None = None,
) -> NvmlBackend:
    """The backend for this process: real pynvml, or (explicitly chosen) a mock fleet.

    Real NVML is loaded from `driver_root` (the plugin's `--nvidia-driver-root`;
    default: the NVIDIA_DRIVER_ROOT environment variable, else the loader's path).
    The mock is logged loudly at WARNING: its devices must never be published by
    accident on a real GPU node.
    """
    if mock:
        from driver.nvml.mock.mock_backend import mock_backend  # the only way to the mock

        return mock_backend(fleet_path, node_name, mock_driver_root)
    try:
        import pynvml
    except ImportError as err:  # pragma: no cover - pynvml is a hard dependency
        raise NvmlUnavailableError(f"pynvml is not installed: {err}") from err
    if driver_root is None:
        driver_root = os.environ.get("NVIDIA_DRIVER_ROOT", "")
    load_library_from_driver_root(pynvml, str(driver_root))
    return NvmlBackend(pynvml)
