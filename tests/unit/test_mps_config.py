"""GpuConfig's MPS strategy: decoding, defaults, one-line errors naming the field, and
the device rules (never on a MIG device or with admin access)."""

from __future__ import annotations

import json
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


UUID = "GPU-5e6f8a3b-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
PER_DEVICE = f"{P}.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit"


def test_per_device_pinned_limits_decode_and_round_trip() -> None:
    limits = {"0": "5Gi", UUID: "4096Mi", "3": "1Mi"}
    config = decode_gpu_config(
        mps({"defaultPinnedDeviceMemoryLimit": "8Gi", "defaultPerDevicePinnedMemoryLimit": limits})
    )
    assert config.mps is not None
    assert config.mps.defaultPerDevicePinnedMemoryLimit == limits
    wire = config.to_dict()
    assert wire["sharing"]["mpsConfig"]["defaultPerDevicePinnedMemoryLimit"] == limits
    assert json.loads(json.dumps(wire)) == wire
    assert decode_gpu_config(wire) == config
    assert hash(decode_gpu_config(wire)) == hash(config)
    assert decode_gpu_config(mps({"defaultPerDevicePinnedMemoryLimit": {}})).to_dict()["sharing"][
        "mpsConfig"
    ] == {"defaultPerDevicePinnedMemoryLimit": {}}


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        (
            {"1x": "5Gi"},
            f"{PER_DEVICE}[1x]: not a device index (0, 1, ...) or a GPU UUID (GPU-<uuid>)",
        ),
        (
            {"-1": "5Gi"},
            f"{PER_DEVICE}[-1]: not a device index (0, 1, ...) or a GPU UUID (GPU-<uuid>)",
        ),
        (
            {"01": "5Gi"},
            f"{PER_DEVICE}[01]: not a device index (0, 1, ...) or a GPU UUID (GPU-<uuid>)",
        ),
        (
            {"GPU-1234": "5Gi"},
            f"{PER_DEVICE}[GPU-1234]: not a device index (0, 1, ...) or a GPU UUID (GPU-<uuid>)",
        ),
        ({"0": "1k"}, f"{PER_DEVICE}[0]: must be at least 1Mi, got '1k'"),
        ({UUID: "lots"}, f"{PER_DEVICE}[{UUID}]: not a quantity: 'lots' (e.g. 8Gi, 512Mi)"),
        (
            {"0": "1.5Mi"},
            f"{PER_DEVICE}[0]: must be a whole number of Mi (MPS sets limits in MiB), got '1.5Mi'",
        ),
        ({"0": 5368709120}, f"{PER_DEVICE}[0]: must be a string"),
        ("5Gi", f"{PER_DEVICE}: must be an object"),
    ],
)
def test_bad_per_device_limits_are_one_line_errors_naming_field_and_key(
    limits: Any, expected: str
) -> None:
    assert messages(mps({"defaultPerDevicePinnedMemoryLimit": limits})) == [expected]


def test_every_bad_per_device_entry_is_reported() -> None:
    limits = {"0": "1k", "x": "5Gi", "1": "5Gi"}
    assert messages(mps({"defaultPerDevicePinnedMemoryLimit": limits})) == [
        f"{PER_DEVICE}[0]: must be at least 1Mi, got '1k'",
        f"{PER_DEVICE}[x]: not a device index (0, 1, ...) or a GPU UUID (GPU-<uuid>)",
    ]


def test_per_device_keys_as_yaml_and_json_write_them() -> None:
    doc = (
        "apiVersion: " + API_VERSION + "\nkind: " + KIND + "\nsharing:\n  strategy: MPS\n"
        "  mpsConfig:\n    defaultPerDevicePinnedMemoryLimit:\n"
    )
    quoted = decode_gpu_config(doc + '      "0": 5Gi\n')
    assert quoted.mps is not None
    assert quoted.mps.defaultPerDevicePinnedMemoryLimit == {"0": "5Gi"}
    assert messages(doc + "      0: 5Gi\n") == [
        f'{PER_DEVICE}[0]: keys must be strings (in YAML, quote them: "0")'
    ]
    twice = '{"apiVersion": "%s", "kind": "%s", "sharing": {"strategy": "MPS", "mpsConfig": '
    twice += '{"defaultPerDevicePinnedMemoryLimit": {"0": "1Gi", "0": "2Gi"}}}}'
    assert messages(twice % (API_VERSION, KIND)) == [f"{PER_DEVICE}[0]: duplicate key"]


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
