"""The real-GPU tier (`make test-gpu`): runs against the host's libnvidia-ml.

Without a usable NVML library or GPU the whole tier skips; a GPU in the wrong MIG
mode for a group of tests, or with an administrator's MIG devices, makes that group
skip (tests/gpu/gates.py). The run ends with one line per reason, printed with -q
too. Nothing here changes a GPU's MIG mode or resets a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import GpuInfo, Inventory
from driver.nvml.library import NvmlUnavailableError
from tests.gpu.gates import Gate, TierGates, summary_lines
from tests.gpu.node import host_backend


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.gpu)


def _discover() -> Inventory | str:
    """What NVML reports at the start of the run, or why this host cannot run the tier."""
    try:
        inventory = host_backend().discover()
    except NvmlUnavailableError as err:
        return str(err)
    return inventory if inventory.gpus else "NVML reports 0 devices"


_FOUND = _discover()
_GATES = TierGates.of(_FOUND.gpus) if isinstance(_FOUND, Inventory) else None


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in summary_lines(_FOUND):
        terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def _gpu_present() -> None:
    if isinstance(_FOUND, str):
        pytest.skip(f"no NVIDIA GPU on this host: {_FOUND}")


def _gpu_of(gate: Gate) -> GpuInfo:
    if gate.gpu is None:
        pytest.skip(str(gate.skip))
    return gate.gpu


@pytest.fixture(scope="session")
def gates() -> TierGates:
    assert _GATES is not None
    return _GATES


@pytest.fixture
def whole_gpu(gates: TierGates) -> GpuInfo:
    """A GPU with MIG mode off."""
    return _gpu_of(gates.whole_gpu)


@pytest.fixture
def dynamic_mig_gpu(gates: TierGates) -> GpuInfo:
    """A GPU in MIG mode without MIG devices at the start of the run."""
    return _gpu_of(gates.dynamic_mig)


@pytest.fixture
def static_mig_gpu(gates: TierGates) -> GpuInfo:
    """A GPU in MIG mode with an administrator's MIG devices."""
    return _gpu_of(gates.static_mig)


@pytest.fixture(scope="session")
def backend() -> NvmlBackend:
    return host_backend()


@pytest.fixture(scope="session")
def inventory(backend: NvmlBackend) -> Inventory:
    return backend.discover()


@pytest.fixture
def pynvml_session(backend: NvmlBackend) -> Iterator[Any]:
    module = backend.module
    module.nvmlInit()
    yield module
    module.nvmlShutdown()
