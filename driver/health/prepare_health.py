"""Device health as prepare asks for it (`driver.state.request.DeviceHealth`): the
health store's answer, and the taint made sure of before a refusal."""

from __future__ import annotations

from driver.errors import transient
from driver.health.clear import Publisher
from driver.health.store import Devices, HealthDevice, HealthStore, device_list
from driver.health.xid import DEFAULT_TAINT_EFFECT, INFORMATIONAL_EFFECT


class KubeDeviceHealth:
    """`DeviceHealth` for prepare: answers from the store, taints through the publisher.

    `ensure_tainted` triggers a republish and waits until a reconcile that started
    after the trigger has succeeded, i.e. the API server has accepted the slices that
    carry the taint (the publisher's desired state is built from the same store).

    With the taint effect `None` (`--xid-taint-effect=None`) health is informational:
    the taint is published, the health stream reports the device unhealthy, but the
    scheduler keeps choosing it, so prepare must not refuse it either (a refusal
    would fail every claim the scheduler puts there, for good).
    """

    def __init__(
        self,
        store: HealthStore,
        publisher: Publisher,
        devices: Devices,
        *,
        effect: str = DEFAULT_TAINT_EFFECT,
        sync_timeout: float = 10.0,
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._devices: dict[str, HealthDevice] = {d.name: d for d in device_list(devices)}
        self._refuses = effect != INFORMATIONAL_EFFECT
        self._timeout = sync_timeout

    def failure(self, device_name: str) -> str | None:
        device = self._devices.get(device_name)
        if device is None or not self._refuses:
            return None
        failure = self._store.device_failure(device)
        return failure.message() if failure is not None else None

    def ensure_tainted(self, device_name: str) -> None:
        device = self._devices.get(device_name)
        if device is None or self._store.device_failure(device) is None:
            raise transient(f"device {device_name}: no recorded failure to publish as a taint")
        ticket = self._publisher.trigger()
        if not self._publisher.wait_synced(ticket, self._timeout):
            raise transient(
                f"device {device_name}: the API server has not accepted its taint within "
                f"{self._timeout:.0f}s; retrying"
            )


class NoDeviceHealth:
    """`DeviceHealth` before discovery: no device is known to have failed, and there
    is nothing to taint. Replaced by `KubeDeviceHealth` before any prepare."""

    def failure(self, device_name: str) -> str | None:
        return None

    def ensure_tainted(self, device_name: str) -> None:
        raise RuntimeError(f"device {device_name}: health is not wired yet")
