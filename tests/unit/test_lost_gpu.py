"""One lost GPU must not take the node down (docs/mig.md, "A lost GPU").

nvml.h: `nvmlDeviceGetHandleByUUID` answers NVML_ERROR_GPU_IS_LOST "if *any* GPU has
fallen off the bus or is otherwise inaccessible", `nvmlDeviceGetHandleByIndex` only "if
the *target* GPU has fallen off the bus". The mock models both; the MIG manager finds a
healthy GPU by index while another is lost, and every NVML error on the MIG paths is a
classified error: prepare fails per claim, unprepare and start-up recovery go on.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver.errors import DriverError
from driver.nvml.backend import NvmlBackend
from driver.nvml.mig.mig_manager import MigError, MigManager, MigTarget
from driver.nvml.mock import mock_api as m
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.prepare import DeviceState
from driver.state.request import ClaimRef
from tests.unit.test_mig_prepare import NODE, Node, make_node, mig_state

TWO = {"gpus": [{"model": "H100-80GB", "count": 2}]}
ONE_G = 19  # the H100's 1g.10gb GPU-instance profile


def _code(fn: Any) -> int:
    with pytest.raises(m.NVMLError) as err:
        fn()
    return int(err.value.value)


# -- the mock: NVML's lookup rules ---------------------------------------------------


def test_lookup_by_uuid_answers_gpu_is_lost_for_every_gpu_while_one_is_lost() -> None:
    nvml = MockNvml(parse_fleet(TWO), NODE)
    gpu0, gpu1 = (g.uuid for g in nvml.gpus)
    made = MigManager(nvml).create(MigTarget(gpu0, ONE_G, (0, 1), 1))
    assert made.uuid is not None
    nvml.nvmlInit()
    h0 = nvml.nvmlDeviceGetHandleByUUID(gpu0)

    nvml.inject_gpu_lost(gpu1)
    for uuid in (gpu0, gpu1, made.uuid, "GPU-not-on-this-node"):
        assert _code(lambda u=uuid: nvml.nvmlDeviceGetHandleByUUID(u)) == m.NVML_ERROR_GPU_IS_LOST
    # By index only the lost GPU fails; the healthy one answers as before.
    assert nvml.nvmlDeviceGetHandleByIndex(0) is h0
    assert nvml.nvmlDeviceGetUUID(h0) == gpu0
    assert _code(lambda: nvml.nvmlDeviceGetHandleByIndex(1)) == m.NVML_ERROR_GPU_IS_LOST

    nvml.reset(gpu1)
    assert nvml.nvmlDeviceGetHandleByUUID(gpu0) is h0
    assert _code(lambda: nvml.nvmlDeviceGetHandleByUUID("GPU-nope")) == m.NVML_ERROR_NOT_FOUND
    nvml.nvmlShutdown()


# -- the MIG manager ---------------------------------------------------------------------


class TargetLostByIndex:
    """The mock, with `nvmlDeviceGetHandleByIndex` failing for the lost GPU itself (as
    nvml.h documents; the mock hands out the handle and fails its queries)."""

    def __init__(self, inner: MockNvml) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if self._inner.is_lost(self._inner.gpus[index].uuid):
            raise m.NVMLError(m.NVML_ERROR_GPU_IS_LOST)
        return self._inner.nvmlDeviceGetHandleByIndex(index)


@pytest.mark.parametrize("strict_index", [False, True])
def test_mig_manager_keeps_a_healthy_gpu_usable_while_another_is_lost(strict_index: bool) -> None:
    mock = MockNvml(parse_fleet(TWO), NODE)
    gpu0, gpu1 = (g.uuid for g in mock.gpus)
    manager = NvmlBackend(TargetLostByIndex(mock) if strict_index else mock).mig()
    first = manager.create(MigTarget(gpu0, ONE_G, (0, 1), 1))
    mock.inject_gpu_lost(gpu1)

    assert manager.instances(gpu0) == [first]
    second = manager.create(MigTarget(gpu0, ONE_G, (1, 1), 1))
    assert [i.placement for i in manager.instances(gpu0)] == [(0, 1), (1, 1)]
    assert manager.destroy(gpu0, second.gi_id) is True
    for call in (
        lambda: manager.instances(gpu1),
        lambda: manager.create(MigTarget(gpu1, ONE_G, (0, 1), 1)),
        lambda: manager.destroy(gpu1, 1),
    ):
        with pytest.raises(MigError) as err:
            call()
        assert err.value.code == "NVML_ERROR_GPU_IS_LOST" and err.value.gpu_gone
        assert gpu1 in str(err.value)
    assert mock._init_count == 0  # every session shut down


def test_nvml_that_cannot_start_is_a_mig_error(monkeypatch: pytest.MonkeyPatch) -> None:
    mock = MockNvml(parse_fleet(TWO), NODE)
    manager = MigManager(mock)

    def driver_not_loaded() -> None:
        raise m.NVMLError(m.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(mock, "nvmlInit", driver_not_loaded)
    with pytest.raises(MigError) as err:
        manager.instances(mock.gpus[0].uuid)
    assert not isinstance(err.value, m.NVMLError)
    assert err.value.code == "NVML_ERROR_DRIVER_NOT_LOADED" and not err.value.gpu_gone
    assert err.value.retryable


def test_discovery_publishes_the_healthy_gpus_while_one_is_lost() -> None:
    mock = MockNvml(parse_fleet(TWO), NODE)
    backend = MockBackend(mock)
    made = backend.mig().create(MigTarget(mock.gpus[0].uuid, ONE_G, (0, 1), 1))
    mock.inject_gpu_lost(mock.gpus[1].uuid)
    (gpu,) = backend.discover().gpus
    assert gpu.uuid == mock.gpus[0].uuid and gpu.mig_instances == (made,)


def test_health_events_are_registered_for_the_healthy_gpus_while_one_is_lost() -> None:
    """The monitor's (re)open walks GPUs by index, where the lost GPU's own lookup
    fails: it is left out, not the reason the monitor cannot start."""
    mock = MockNvml(parse_fleet(TWO), NODE)
    backend = MockBackend(mock)
    mock.inject_gpu_lost(mock.gpus[1].uuid)
    backend.open_event_set()
    try:
        assert backend.monitored_uuids == (mock.gpus[0].uuid,)
    finally:
        backend.close_event_set()


# -- DeviceState on a node whose GPU 1 falls off the bus ---------------------------------


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return make_node(tmp_path, TWO)


def _prepared(node: Node, *claims: tuple[str, str]) -> list[ClaimRef]:
    refs = [node.claims.add(uid, device) for uid, device in claims]
    results = node.state.prepare(refs)
    assert all(r.ok for r in results.values()), results
    return refs


def _restarted(node: Node) -> DeviceState:
    """A new plugin process on the same node (same NVML: GPU 1 stays lost)."""
    return mig_state(node.root, node.backend, node.claims, node.state.devices)


def _journal(node: Node) -> dict[str, Any]:
    return dict(Checkpoint(node.root / "plugin").load())


def test_recover_reports_a_lost_gpu_and_goes_on(node: Node) -> None:
    _prepared(
        node,
        ("a", "gpu-0-mig-1g10gb-0"),
        ("b", "gpu-1-mig-1g10gb-0"),
        ("c", "gpu-1-mig-1g10gb-1"),
    )
    journal = _journal(node)  # c: a crash in the middle of its prepare
    journal["c"] = replace(journal["c"], state=ClaimState.PREPARE_STARTED, cdi_spec=None)
    Checkpoint(node.root / "plugin").store(journal)
    for path in (node.root / "cdi").glob("*_[abc].json"):
        path.unlink()  # the CDI root is a tmpfs
    node.mock.mock_reboot()  # every MIG device is gone ...
    node.mock.inject_gpu_lost(node.mock.gpus[1].uuid)  # ... and GPU 1 came back lost

    report = _restarted(node).recover()  # returns: the plugin starts

    assert report.restored_mig == ("a",)  # the healthy GPU's claim got its device back
    assert [i.placement for i in node.live(0)] == [(0, 1)]
    assert report.rolled_back == ("c",)  # its MIG device went with the GPU
    assert any(p.startswith("b:") and "GPU_IS_LOST" in p for p in report.problems)
    assert sorted(report.recreated_specs) == ["a", "b"]
    journal = _journal(node)
    assert sorted(journal) == ["a", "b"]  # b stays prepared until its unprepare
    assert journal["b"].state is ClaimState.PREPARE_COMPLETED


def test_unprepare_of_a_batch_with_a_lost_gpu_succeeds_for_every_claim(node: Node) -> None:
    refs = _prepared(node, ("a", "gpu-0-mig-1g10gb-0"), ("b", "gpu-1-mig-1g10gb-0"))
    node.mock.inject_gpu_lost(node.mock.gpus[1].uuid)

    assert node.state.unprepare(refs) == {"a": None, "b": None}

    assert node.live(0) == []  # the healthy GPU's MIG device is destroyed
    assert _journal(node) == {}
    assert not node.state.cdi.list_claim_specs()
    assert node.state.unprepare(refs) == {"a": None, "b": None}  # a repeat: nothing to do


def test_prepare_on_a_healthy_gpu_while_another_is_lost(node: Node) -> None:
    node.mock.inject_gpu_lost(node.mock.gpus[1].uuid)
    ok = node.claims.add("ok", "gpu-0-mig-1g10gb-3")
    lost = node.claims.add("lost", "gpu-1-mig-1g10gb-3")

    results = node.state.prepare([ok, lost])

    assert results["ok"].ok, results["ok"].error
    assert [i.placement for i in node.live(0)] == [(3, 1)]
    error = results["lost"].error
    assert isinstance(error, DriverError) and not error.permanent
    assert "gpu-1-mig-1g10gb-3" in str(error) and "NVML_ERROR_GPU_IS_LOST" in str(error)
    assert sorted(_journal(node)) == ["ok"]  # nothing of the failed claim is left
    assert list(node.state.cdi.list_claim_specs()) == ["ok"]


def test_unprepare_without_nvml_fails_only_the_claims_that_need_it(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    (mig,) = _prepared(node, ("mig", "gpu-0-mig-2g20gb-0"))
    admin = node.claims.add("admin", "gpu-0-mig-2g20gb-0")  # creates no MIG device
    node.claims.docs["admin"]["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    assert node.state.prepare([admin])["admin"].ok

    def driver_not_loaded() -> None:
        raise m.NVMLError(m.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(node.mock, "nvmlInit", driver_not_loaded)
    results = node.state.unprepare([mig, admin])

    assert results["admin"] is None
    error = results["mig"]
    assert isinstance(error, DriverError) and not error.permanent
    assert "NVML_ERROR_DRIVER_NOT_LOADED" in str(error)
    assert sorted(_journal(node)) == ["mig"]  # its MIG device may still exist: kept

    monkeypatch.undo()
    assert node.state.unprepare([mig]) == {"mig": None}  # the kubelet's repeat
    assert node.live(0) == [] and _journal(node) == {}


def test_an_unexpected_failure_fails_only_its_own_claim(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = _prepared(node, ("a", "gpu-0-mig-1g10gb-0"), ("b", "gpu-1-mig-1g10gb-0"))
    manager = node.state.instances._ops
    assert manager is not None
    destroy = manager.destroy

    def flaky(gpu_uuid: str, *args: Any) -> Any:
        if gpu_uuid == node.mock.gpus[1].uuid:
            raise RuntimeError("a bug")
        return destroy(gpu_uuid, *args)

    monkeypatch.setattr(manager, "destroy", flaky)
    results = node.state.unprepare(refs)
    assert results["a"] is None
    assert isinstance(results["b"], DriverError) and not results["b"].permanent
    assert sorted(_journal(node)) == ["b"]


def test_a_gpu_no_longer_on_the_node_does_not_block_unprepare(node: Node) -> None:
    """NVML does not know the GPU (NOT_FOUND for the GPU itself: removed, unbound, a
    different board after a reboot): its MIG devices went with it."""
    (ref,) = _prepared(node, ("b", "gpu-1-mig-1g10gb-0"))
    journal = _journal(node)
    moved = []
    for device in journal["b"].devices:
        assert device.mig is not None
        moved.append(replace(device, mig=replace(device.mig, gpu_uuid="GPU-not-on-this-node")))
    journal["b"] = replace(journal["b"], devices=tuple(moved))
    Checkpoint(node.root / "plugin").store(journal)

    assert node.state.unprepare([ref]) == {"b": None}
    assert _journal(node) == {}
