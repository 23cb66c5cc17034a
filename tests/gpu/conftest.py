"""The real-GPU tier (`make test-gpu`): runs against the host's libnvidia-ml.

Without a usable NVML library or GPU the whole tier skips with one line saying why;
that is the only skip in the project. Nothing here changes a GPU's MIG mode or resets
a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from driver.nvml.backend import NvmlBackend, select_backend
from driver.nvml.library import NvmlUnavailableError
from driver.nvml.types import Inventory


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.gpu)


def nvml_unavailable() -> str | None:
    """Why this host cannot run the tier, or None."""
    try:
        inventory = select_backend(mock=False).discover()
    except NvmlUnavailableError as err:
        return str(err)
    return None if inventory.gpus else "NVML reports 0 devices"


_REASON = nvml_unavailable()


def pytest_report_header() -> str:
    if _REASON is None:
        return "real-GPU tier: NVML found a GPU"
    return f"real-GPU tier: every test skips: no NVIDIA GPU on this host: {_REASON}"


@pytest.fixture(scope="session", autouse=True)
def _gpu_present() -> None:
    if _REASON is not None:
        pytest.skip(f"no NVIDIA GPU on this host: {_REASON}")


@pytest.fixture(scope="session")
def backend() -> NvmlBackend:
    return select_backend(mock=False)


@pytest.fixture(scope="session")
def inventory(backend: NvmlBackend) -> Inventory:
    return backend.discover()


@pytest.fixture
def pynvml_session(backend: NvmlBackend) -> Iterator[Any]:
    module = backend.module
    module.nvmlInit()
    yield module
    module.nvmlShutdown()
