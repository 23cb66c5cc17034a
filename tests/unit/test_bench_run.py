"""bench.run: which drivers take turns, why NVIDIA's plugin sits a run out, and the
claims each driver's turns use."""

from __future__ import annotations

from pathlib import Path

from bench.plugins import DRIVER, NVIDIA_DRIVER, NVML_LIBRARY
from bench.run import nvidia_unavailable, turn_order
from bench.runner import claim_name
from bench.scenarios import device_class


def test_without_nvidia_the_turn_order_is_the_one_of_the_earlier_runs() -> None:
    both = turn_order(reference=True, shipped_reference=True, nvidia=False)
    assert both == ["ours", "reference_unthrottled", "reference"]
    assert turn_order(reference=True, shipped_reference=False, nvidia=False) == [
        "ours",
        "reference_unthrottled",
    ]
    assert turn_order(reference=False, shipped_reference=True, nvidia=False) == ["ours"]


def test_nvidia_takes_its_turn_with_the_unthrottled_drivers_before_the_throttled_one() -> None:
    assert turn_order(reference=True, shipped_reference=True, nvidia=True) == [
        "ours",
        "reference_unthrottled",
        "nvidia",
        "reference",
    ]
    assert turn_order(reference=False, shipped_reference=True, nvidia=True) == ["ours", "nvidia"]


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_nvidia_sits_out_with_a_note_naming_what_is_missing(tmp_path: Path) -> None:
    binary = str(_executable(tmp_path / "gpu-kubelet-plugin"))
    nvml = tmp_path / "mocknvml"
    nvml.mkdir()
    missing_plugin = nvidia_unavailable(None, str(nvml))
    assert missing_plugin is not None and "--nvidia-plugin" in missing_plugin
    not_executable = tmp_path / "plain-file"
    not_executable.write_text("")
    note = nvidia_unavailable(str(not_executable), str(nvml))
    assert note is not None and "not an executable file" in note
    missing_root = nvidia_unavailable(binary, None)
    assert missing_root is not None and "--nvidia-nvml-root" in missing_root
    empty_root = nvidia_unavailable(binary, str(nvml))
    assert empty_root is not None and NVML_LIBRARY in empty_root


def test_nvidia_runs_when_its_binary_and_the_mock_library_are_there(tmp_path: Path) -> None:
    binary = str(_executable(tmp_path / "gpu-kubelet-plugin"))
    nvml = tmp_path / "mocknvml"
    nvml.mkdir()
    (nvml / NVML_LIBRARY).write_bytes(b"\x7fELF")
    assert nvidia_unavailable(binary, str(nvml)) is None


def test_the_drivers_of_gpu_example_com_keep_their_claim_and_class_names() -> None:
    assert claim_name("batch-7", DRIVER) == "batch-7"
    assert device_class(DRIVER) == "bench-gpu.example.com"


def test_nvidia_gets_claims_and_a_class_of_its_own() -> None:
    assert claim_name("batch-7", NVIDIA_DRIVER) == "batch-7-nvidia"
    assert device_class(NVIDIA_DRIVER) == "bench-gpu.nvidia.com"
