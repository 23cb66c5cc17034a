"""GpuConfig's MPS strategy: decoding, defaults, one-line errors naming the field, and
the device rules (never on a MIG device or with admin access)."""

from __future__ import annotations

from typing import Any

import pytest

from driver.config import (
    API_VERSION,
    KIND,
    ConfigError,
    Strategy,
    decode_gpu_config,
    validate_for_device,
)
from driver.config.gpu import MpsConfig
from driver.config.mps_limits import memory_limit_bytes, mps_memory_text

P = "spec.devices.config[0].opaque.parameters"


def mps(config: Any = None) -> dict[str, Any]:
    sharing: dict[str, Any] = {"strategy": "MPS"}
    if config is not None:
        sharing["mpsConfig"] = config
    return {"apiVersion": API_VERSION, "kind": KIND, "sharing": sharing}


def messages(parameters: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        decode_gpu_config(parameters, P)
    return [f"{e.path}: {e.message}" for e in info.value.errors]


def test_mps_with_limits_decodes() -> None:
    config = decode_gpu_config(
        mps({"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "8Gi"})
    )
    assert config.strategy is Strategy.MPS
    assert config.mps == MpsConfig(50, "8Gi")
    assert config.interval is None and config.partition_count is None
    assert config.to_dict()["sharing"]["mpsConfig"] == {
        "defaultActiveThreadPercentage": 50,
        "defaultPinnedDeviceMemoryLimit": "8Gi",
    }


def test_mps_without_config_gets_an_empty_one() -> None:
    config = decode_gpu_config(mps())
    assert config.mps == MpsConfig()
    assert config.sharing is not None and config.sharing.mpsConfig == MpsConfig()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            {"defaultActiveThreadPercentage": 0},
            f"{P}.sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100, "
            "got 0",
        ),
        (
            {"defaultActiveThreadPercentage": 101},
            f"{P}.sharing.mpsConfig.defaultActiveThreadPercentage: must be between 1 and 100, "
            "got 101",
        ),
        (
            {"defaultActiveThreadPercentage": "50"},
            f"{P}.sharing.mpsConfig.defaultActiveThreadPercentage: must be an integer",
        ),
        (
            {"defaultPinnedDeviceMemoryLimit": "lots"},
            f"{P}.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: not a quantity: 'lots' "
            "(e.g. 8Gi, 512Mi)",
        ),
        (
            {"defaultPinnedDeviceMemoryLimit": "1k"},
            f"{P}.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: must be at least 1Mi, got '1k'",
        ),
        (
            {"defaultPinnedDeviceMemoryLimit": "1.5Mi"},
            f"{P}.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: must be a whole number of Mi "
            "(MPS sets limits in MiB), got '1.5Mi'",
        ),
        ({"threads": 5}, f"{P}.sharing.mpsConfig.threads: unknown field"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_field(config: Any, expected: str) -> None:
    assert messages(mps(config)) == [expected]


def test_mps_config_belongs_to_the_mps_strategy() -> None:
    doc = mps({"defaultActiveThreadPercentage": 50})
    doc["sharing"]["strategy"] = "TimeSlicing"
    assert messages(doc) == [f"{P}.sharing.mpsConfig: not allowed with strategy TimeSlicing"]
    doc = mps({"defaultActiveThreadPercentage": 50})
    doc["sharing"]["timeSlicingConfig"] = {"interval": "Long"}
    assert messages(doc) == [f"{P}.sharing: timeSlicingConfig and mpsConfig are mutually exclusive"]


def test_memory_limit_text_for_mps() -> None:
    assert memory_limit_bytes("8Gi") == 8 << 30
    assert mps_memory_text(memory_limit_bytes("8Gi")) == "8192M"
    assert mps_memory_text(memory_limit_bytes("512Mi")) == "512M"


@pytest.mark.parametrize(
    ("reason", "device"),
    [
        ("a MIG device: its GPU is in MIG mode", "gpu-0-mig-1g10gb-0"),
        ("with admin access, which observes a GPU other claims use", "gpu-1"),
    ],
)
def test_mps_is_refused_where_no_daemon_can_serve(reason: str, device: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_for_device(
            decode_gpu_config(mps()),
            device_name=device,
            is_partition=False,
            max_partitions=None,
            no_time_slice=reason,
            path=P,
        )
    assert info.value.permanent
    assert str(info.value) == (
        f"permanent (invalid-config): {P}.sharing.strategy: MPS is not possible on device "
        f"{device} ({reason}); use a GPU with MIG mode off, without admin access"
    )


def test_mps_is_allowed_on_a_whole_gpu_and_a_share() -> None:
    config = decode_gpu_config(mps({"defaultPinnedDeviceMemoryLimit": "4Gi"}))
    validate_for_device(config, device_name="gpu-0", is_partition=False, max_partitions=None)
    validate_for_device(
        config, device_name="gpu-0", is_partition=False, max_partitions=None, share=True
    )
