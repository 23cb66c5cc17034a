"""What the mock NVML costs a plugin start: its MIG state is parsed once while it does
not change (another process's change is still seen at the next call), and its files
are written without fsync (nothing on a mock's driver root has to survive a power
loss)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest

from driver.nvml.backend import NvmlBackend
from driver.nvml.mock.fleet import default_fleet
from driver.nvml.mock.mig import mig_state as ms
from driver.nvml.mock.mig import mig_store
from driver.nvml.mock.nvml import MockNvml
from driver.nvml.selection import select_backend

NODE = "node-a"


def _backend(fleet: str, driver_root: Path) -> NvmlBackend:
    return select_backend(mock=True, fleet_path=fleet, node_name=NODE, mock_driver_root=driver_root)


def _count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    calls = [0]
    real = getattr(owner, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_a_discovery_parses_the_unchanged_mig_state_at_most_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend("default", tmp_path)  # 8 H100 with MIG enabled
    parses = _count_calls(monkeypatch, mig_store, "_load")
    inventory = backend.discover()
    assert len(inventory.gpus) == 8
    assert parses[0] <= 1, f"the MIG state file was parsed {parses[0]} times"


def _gpu_instance_ids(nvml: MockNvml, gpu: Any, profile_id: int) -> list[int]:
    array = (ms.c_nvmlGpuInstance_t * 8)()
    count = ctypes.c_uint(8)
    nvml.nvmlDeviceGetGpuInstances(gpu, profile_id, array, ctypes.byref(count))
    return [nvml.nvmlGpuInstanceGetInfo(array[i]).id for i in range(count.value)]


def test_a_change_by_another_process_is_seen_at_the_next_call(tmp_path: Path) -> None:
    plugin = MockNvml(default_fleet(), NODE, driver_root=tmp_path)
    plugin.nvmlInit()
    gpu = plugin.nvmlDeviceGetHandleByIndex(0)
    profile = plugin.nvmlDeviceGetGpuInstanceProfileInfo(gpu, 0).id  # 1g.10gb
    assert _gpu_instance_ids(plugin, gpu, profile) == []
    other = MockNvml(default_fleet(), NODE, driver_root=tmp_path)  # a CLI, say
    other.nvmlInit()
    created = other.nvmlDeviceCreateGpuInstance(other.nvmlDeviceGetHandleByIndex(0), profile)
    created_id = other.nvmlGpuInstanceGetInfo(created).id
    assert _gpu_instance_ids(plugin, gpu, profile) == [created_id]
    other.nvmlGpuInstanceDestroy(created)
    assert _gpu_instance_ids(plugin, gpu, profile) == []


@pytest.mark.parametrize("fleet", ["example", "default"])
def test_the_mock_writes_its_files_without_fsync(
    fleet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsyncs = _count_calls(monkeypatch, os, "fsync")
    _backend(fleet, tmp_path).discover()
    assert (tmp_path / ms.STATE_FILE).exists() and (tmp_path / ms.MIG_MINORS_FILE).exists()
    assert fsyncs[0] == 0
