"""The MIG lifecycle on a real GPU in MIG mode (`make test-gpu`): the scenarios of
tests/gpu/mig_scenarios.py on the GPU tests/gpu/gates.py chose. With MIG mode off on
every GPU they skip with one line saying so; this suite never changes MIG mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import GpuInfo
from tests.gpu import mig_scenarios
from tests.gpu.crash_child import CRASH_POINTS
from tests.gpu.gates import TierGates


def test_dynamic_prepare_creates_the_mig_device_its_spec_names_and_unprepare_destroys_it(
    backend: NvmlBackend, gates: TierGates, dynamic_mig_gpu: GpuInfo, tmp_path: Path
) -> None:
    mig_scenarios.prepare_creates_the_device_the_spec_names(
        backend, tmp_path, dynamic_mig_gpu, gates.dynamic_strategy
    )


@pytest.mark.parametrize("crash_point", CRASH_POINTS)
def test_recovery_after_a_killed_prepare_destroys_only_what_the_attempt_created(
    crash_point: str,
    backend: NvmlBackend,
    gates: TierGates,
    dynamic_mig_gpu: GpuInfo,
    tmp_path: Path,
) -> None:
    mig_scenarios.crash_then_recover(
        backend, tmp_path, dynamic_mig_gpu, crash_point, gates.dynamic_strategy
    )


def test_static_mig_devices_are_prepared_as_they_are_and_never_destroyed(
    backend: NvmlBackend, static_mig_gpu: GpuInfo, tmp_path: Path
) -> None:
    mig_scenarios.static_devices_are_prepared_as_they_are(backend, tmp_path, static_mig_gpu)
