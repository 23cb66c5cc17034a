"""The mock NVML's compute modes as nvml.h declares `nvmlDeviceGetComputeMode` and
`nvmlDeviceSetComputeMode`, and what EXCLUSIVE_PROCESS and PROHIBITED do to the CUDA
contexts of the mock's processes (driver/nvml/mock/mock_compute_mode.py); the real
backend's wrapper (driver/nvml/compute_mode.py) over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.errors import DriverError
from driver.nvml.backend import NvmlBackend
from driver.nvml.compute_mode import mode_name
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_api import (
    NVML_COMPUTEMODE_DEFAULT,
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    NVML_COMPUTEMODE_EXCLUSIVE_THREAD,
    NVML_COMPUTEMODE_PROHIBITED,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNINITIALIZED,
    NVMLError,
)
from driver.nvml.mock.mock_compute_mode import DevicesUnavailable
from driver.nvml.mock.nvml import MockNvml

FLEET = parse_fleet(
    {"gpus": [{"model": "H100-80GB", "count": 2, "migMode": "disabled"}, {"model": "H100-80GB"}]}
)


def _mock(root: Path | None = None) -> MockNvml:
    mock = MockNvml(FLEET, "node-a", driver_root=root)
    mock.privileged = True
    mock.nvmlInit()
    return mock


def _code(err: pytest.ExceptionInfo[NVMLError]) -> int:
    return int(err.value.value)


def test_get_and_set_as_nvml_declares_them(tmp_path: Path) -> None:
    mock = _mock(tmp_path)
    gpu = mock.nvmlDeviceGetHandleByIndex(0)
    assert mock.nvmlDeviceGetComputeMode(gpu) == NVML_COMPUTEMODE_DEFAULT
    mock.nvmlDeviceSetComputeMode(gpu, NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert mock.nvmlDeviceGetComputeMode(gpu) == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert mock.nvmlDeviceGetComputeMode(mock.nvmlDeviceGetHandleByIndex(1)) == 0
    for mode, code in (
        (7, NVML_ERROR_INVALID_ARGUMENT),
        (-1, NVML_ERROR_INVALID_ARGUMENT),
        (NVML_COMPUTEMODE_EXCLUSIVE_THREAD, NVML_ERROR_NOT_SUPPORTED),  # support removed
    ):
        with pytest.raises(NVMLError) as err:
            mock.nvmlDeviceSetComputeMode(gpu, mode)
        assert _code(err) == code
    with pytest.raises(NVMLError) as err:
        mock.nvmlDeviceGetComputeMode(object())
    assert _code(err) == NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(NVMLError) as err:  # a GPU in MIG mode: the mock keeps none
        mock.nvmlDeviceGetComputeMode(mock.nvmlDeviceGetHandleByIndex(2))
    assert _code(err) == NVML_ERROR_NOT_SUPPORTED
    mock.privileged = False  # "Requires root/admin permissions"
    with pytest.raises(NVMLError) as err:
        mock.nvmlDeviceSetComputeMode(gpu, NVML_COMPUTEMODE_DEFAULT)
    assert _code(err) == NVML_ERROR_NO_PERMISSION
    mock.inject_gpu_lost(mock.gpus[0].uuid)
    with pytest.raises(NVMLError) as err:
        mock.nvmlDeviceGetComputeMode(gpu)
    assert _code(err) == NVML_ERROR_GPU_IS_LOST
    fresh = MockNvml(FLEET, "node-a")
    with pytest.raises(NVMLError) as err:
        fresh.nvmlDeviceGetComputeMode(gpu)
    assert _code(err) == NVML_ERROR_UNINITIALIZED


def test_a_mode_survives_a_plugin_restart_and_a_reboot_resets_it(tmp_path: Path) -> None:
    mock = _mock(tmp_path)
    uuid = mock.gpus[0].uuid
    mock.nvmlDeviceSetComputeMode(mock.nvmlDeviceGetHandleByIndex(0), 3)
    again = _mock(tmp_path)  # another process on the same driver root
    assert again.compute_mode(uuid) == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    again.mock_reboot()  # "not persistent across reboots and always resets to Default"
    assert mock.compute_mode(uuid) == NVML_COMPUTEMODE_DEFAULT
    memory = _mock()
    memory.nvmlDeviceSetComputeMode(memory.nvmlDeviceGetHandleByIndex(0), 2)
    assert memory.compute_mode(uuid) == NVML_COMPUTEMODE_PROHIBITED


def test_exclusive_process_admits_one_context_and_the_clients_of_its_mps_server() -> None:
    mock = _mock()
    uuid = mock.gpus[0].uuid
    mock.nvmlDeviceSetComputeMode(mock.nvmlDeviceGetHandleByIndex(0), 3)
    client = mock.start_process(uuid, "mps-client")  # starts the GPU's MPS server
    assert [p.kind for p in mock.processes(uuid)] == ["mps-server", "mps-client"]
    with pytest.raises(DevicesUnavailable, match="all CUDA-capable devices are busy"):
        mock.start_process(uuid, "compute")
    assert mock.start_process(uuid, "mps-client").pid > client.pid
    assert mock.start_process(mock.gpus[1].uuid, "compute")  # another GPU
    for process in mock.processes(uuid):
        mock.end_process(process.pid)
    # Before the first client starts the server, a process outside MPS can take the
    # one context; then the server cannot start and the client fails.
    outside = mock.start_process(uuid, "compute")
    with pytest.raises(DevicesUnavailable, match=f"process {outside.pid} \\(compute\\)"):
        mock.start_process(uuid, "mps-client")
    assert [p.kind for p in mock.processes(uuid)] == ["compute"]


def test_prohibited_admits_no_context() -> None:
    mock = _mock()
    uuid = mock.gpus[0].uuid
    mock.nvmlDeviceSetComputeMode(mock.nvmlDeviceGetHandleByIndex(0), 2)
    for kind in ("compute", "mps-client"):
        with pytest.raises(DevicesUnavailable, match="Prohibited"):
            mock.start_process(uuid, kind)
    assert mock.processes(uuid) == []


def test_the_backend_sets_and_reads_modes_and_names_the_gpu_when_refused() -> None:
    mock = _mock()
    modes = NvmlBackend(mock, backend_name="mock").compute_modes()
    uuid = mock.gpus[0].uuid
    modes.set(uuid, NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert modes.get(uuid) == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    mock.privileged = False
    with pytest.raises(DriverError) as err:
        modes.set(uuid, NVML_COMPUTEMODE_DEFAULT)
    assert not err.value.permanent
    assert f"set the compute mode Default on GPU {uuid}" in str(err.value)
    assert "needs root" in str(err.value)
    with pytest.raises(DriverError, match="NVML lists no GPU GPU-nope"):
        modes.get("GPU-nope")
    mock.inject_gpu_lost(uuid)
    with pytest.raises(DriverError, match="the GPU is lost"):
        modes.get(uuid)
    assert mode_name(3) == "Exclusive_Process" and mode_name(9) == "mode 9"
