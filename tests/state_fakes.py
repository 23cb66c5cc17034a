"""Collaborators of DeviceState for tests that run it in-process: every device is
healthy, and a permanent failure is a test failure; `device_state` and `node_state`
build the DeviceState with them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from driver.devices.model import PoolOptions, build_pool
from driver.nvml.backend import NvmlBackend
from driver.state.prepare import DeviceState
from driver.state.recovery.startup_recovery import RecoveryReport

DRIVER = "gpu.example.com"
NODE = "node-a"


class Healthy:
    def failure(self, device_name: str) -> str | None:
        return None

    def ensure_tainted(self, device_name: str) -> None:
        raise AssertionError("nothing is failed")


class NoReports:
    def permanent_failure(self, claim: dict[str, Any], error: Any) -> None:
        raise AssertionError(f"unexpected permanent error {error}")


def device_state(root: Path, claims: Any, **kwargs: Any) -> DeviceState:
    """DRIVER's DeviceState on NODE with its CDI specs in `root`/cdi and its journal in
    `root`/plugin, every device healthy; no devices unless `devices`; `kwargs`: the
    rest of DeviceState's arguments."""
    return DeviceState(
        driver_name=DRIVER,
        node_name=NODE,
        devices=kwargs.pop("devices", {}),
        cdi_root=root / "cdi",
        data_dir=root / "plugin",
        claims=claims,
        health=Healthy(),
        reporter=NoReports(),
        **kwargs,
    )


def node_state(
    root: Path,
    claims: Any,
    backend: NvmlBackend,
    options: PoolOptions | None = None,
    **kwargs: Any,
) -> tuple[DeviceState, RecoveryReport]:
    """A plugin (re)start on `backend`'s node: `device_state` with the backend's MIG
    manager, recovered, then given the pool `options` (default: none) publish of the
    backend's GPUs. Returns it and its recovery's report."""
    state = device_state(root, claims, mig=backend.mig(), **kwargs)
    report = state.recover()
    pool = build_pool(backend.discover(), options or PoolOptions(), owned_mig=state.owned_mig())
    state.devices = {d.name: d for d in pool.devices}
    return state, report
