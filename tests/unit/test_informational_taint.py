"""`--xid-taint-effect=None`: a failed GPU's taint is informational. The scheduler keeps
choosing the GPU, so prepare must not refuse it (before: every claim the scheduler put
on it failed for good, "tainted; the scheduler will not pick them again")."""

from __future__ import annotations

import pytest

from driver.errors import ErrorClass
from driver.health.prepare_health import KubeDeviceHealth
from driver.health.store import HealthStore
from tests.taints import untimed
from tests.unit.test_prepare import DEVICES, DRIVER, Env, env, make_claim, result

__all__ = ["env"]  # the fixture


class SyncedPublisher:
    """A publisher whose every reconcile succeeds at once."""

    def __init__(self) -> None:
        self.triggers = 0

    def trigger(self) -> int:
        self.triggers += 1
        return self.triggers

    def wait_synced(self, ticket: int, timeout: float) -> bool:
        return True


def failed_gpu_1(env: Env, effect: str) -> tuple[HealthStore, SyncedPublisher]:
    store = HealthStore(env.data_dir.parent / "health.json")
    store.record_xid(DEVICES["gpu-1"].gpu_uuid, 79)
    publisher = SyncedPublisher()
    health = KubeDeviceHealth(store, publisher, DEVICES, effect=effect)
    env.state = env.new_state(health=health)
    return store, publisher


def test_a_gpu_with_an_informational_taint_is_prepared(env: Env) -> None:
    store, publisher = failed_gpu_1(env, "None")
    ref = env.claims.add(make_claim("uid-1", [result("gpu-1")]))
    prepared = env.prepare_one(ref)
    assert prepared.ok, prepared.error
    assert publisher.triggers == 0  # nothing to wait for: the claim is not refused
    # The health is still published: an informational taint the scheduler ignores.
    taints = untimed(store.device_taints(DEVICES, driver=DRIVER, effect="None"))
    assert taints["gpu-1"] == [{"key": f"{DRIVER}/xid", "value": "79", "effect": "None"}]


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_a_gpu_with_a_scheduling_taint_is_refused(env: Env, effect: str) -> None:
    _, publisher = failed_gpu_1(env, effect)
    ref = env.claims.add(make_claim("uid-1", [result("gpu-1")]))
    error = env.prepare_one(ref).error
    assert error is not None and error.error_class is ErrorClass.DEVICE_FAILED
    assert publisher.triggers == 1  # tainted (accepted by the API server) first
