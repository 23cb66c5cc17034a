"""`mpsConfig.defaultPerDevicePinnedMemoryLimit` at prepare (docs/mps.md): a claim's one
MPS-limited device is CUDA device 0 of its daemon, so the key "0" or the UUID of the
device's GPU overrides `defaultPinnedDeviceMemoryLimit` for it; any other key is
refused for good, and on a share the override may not exceed the share either."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.state.journal.checkpoint import Checkpoint
from driver.state.prepare import DeviceState
from tests.unit.test_mps_prepare import Node, mps_node, ok
from tests.unit.test_mps_shares import FLEET, GIB, SHARES, claim, env, error, limits

FIELD = "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit"


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(tmp_path, FLEET)


def gpu_uuid(state: DeviceState, minor: int) -> str:
    return next(d.gpu_uuid for d in state.devices.values() if d.gpu_minor == minor)


def mps(per_device: dict[str, str], default: str | None = "8Gi") -> dict[str, Any]:
    config: dict[str, Any] = {"defaultPerDevicePinnedMemoryLimit": per_device}
    if default is not None:
        config["defaultPinnedDeviceMemoryLimit"] = default
    return {"strategy": "MPS", "mpsConfig": config}


def test_the_key_0_overrides_the_default_limit(node: Node) -> None:
    state = node.state()
    a = claim(node.claims, "a", "gpu-0", sharing=mps({"0": "5Gi"}))
    ok(state, a)
    assert limits(node, "a") == (None, 5 * GIB)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=5120M" in env(state, "a")
    assert state.unprepare([a]) == {"a": None}
    ok(state, claim(node.claims, "b", "gpu-0", sharing=mps({"0": "3Gi"}, default=None)))
    assert limits(node, "b") == (None, 3 * GIB)


def test_the_uuid_of_the_devices_gpu_overrides_the_default_limit(node: Node) -> None:
    state = node.state()
    uuid = gpu_uuid(state, 0)
    a = claim(node.claims, "a", "gpu-0", sharing=mps({uuid: "6Gi"}))
    ok(state, a)
    assert limits(node, "a") == (None, 6 * GIB)
    assert state.unprepare([a]) == {"a": None}
    ok(state, claim(node.claims, "b", "gpu-0", sharing=mps({uuid.upper(): "7Gi"})))
    assert limits(node, "b") == (None, 7 * GIB)


def test_a_key_of_another_device_is_refused_for_good(node: Node) -> None:
    state = node.state()
    own, other = gpu_uuid(state, 0), gpu_uuid(state, 1)
    message = error(state, claim(node.claims, "a", "gpu-0", sharing=mps({other: "5Gi"})))
    assert message == (
        f"permanent (invalid-config): {FIELD}[{other}]: not the GPU of device gpu-0 "
        f"({own}), the one its MPS daemon serves; use its UUID or 0"
    )
    message = error(state, claim(node.claims, "b", "gpu-0", sharing=mps({"1": "5Gi"})))
    assert message == (
        f"permanent (invalid-config): {FIELD}[1]: the MPS daemon of device gpu-0 serves one "
        "GPU, which its clients see as device 0; use 0 or the GPU's UUID"
    )
    assert node.daemons() == [] and not Checkpoint(node.root / "plugin").load()


def test_two_keys_for_the_one_device_are_refused(node: Node) -> None:
    state = node.state()
    uuid = gpu_uuid(state, 0)
    message = error(state, claim(node.claims, "a", "gpu-0", sharing=mps({"0": "5Gi", uuid: "6Gi"})))
    assert message == (
        f"permanent (invalid-config): {FIELD}[{uuid}]: names device gpu-0, as key 0 "
        "does; give one of them"
    )


def test_a_per_device_limit_may_not_exceed_a_share(node: Node) -> None:
    node.options = SHARES
    state = node.state()
    share = {"memory": "16Gi", "compute": "20"}
    message = error(
        state, claim(node.claims, "a", "gpu-0", consumed=share, sharing=mps({"0": "17Gi"}))
    )
    assert message == (
        f"permanent (invalid-config): {FIELD}[0]: 17Gi is more than the 16384Mi of memory "
        "allocated with device gpu-0"
    )
    # The override, not the default it replaces, is what must fit the share.
    within = mps({"0": "12Gi"}, default="40Gi")
    ok(state, claim(node.claims, "b", "gpu-0", consumed=share, sharing=within))
    assert limits(node, "b") == (20, 12 * GIB)
