"""A GPU instance without a compute instance at a claim's recorded ids, profile and
placement counts as what is left of the claim's MIG device, and the claim's teardown
destroys it: a teardown killed between its two destroys must not hold the placement
for good. The same state is also an administrator's half-made device (a GPU instance
created at a free placement, its compute instance not yet). The teardown leaves such
a device alone wherever it can tell it apart (docs/mig.md, "Crash safety"):

- once this process destroyed the claim's device (or found it gone), whatever sits at
  its ids later is someone else's, however often the claim's teardown is repeated
  (every prepare and unprepare on the node retries a teardown that keeps failing);
- a compute instance created between the check and the destroy makes a MIG device
  that is not the claim's: it is left, never destroyed with its GPU instance."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest

import driver.nvml.mig.mig_recorded as mig_module
from driver.nvml.discovered import MigInstance
from driver.nvml.mig.mig_listing import ci_profiles
from driver.nvml.mig.mig_manager import MigError, MigManager, RecordedInstance
from driver.state.journal.checkpoint import Checkpoint
from tests.unit.test_mig_foreign import _target
from tests.unit.test_mig_prepare import H100, Node, make_node

TWO = ("gpu-0-mig-1g10gb-0", "gpu-0-mig-1g10gb-1")
OTHER = "gpu-0-mig-1g10gb-2"


def _with_nvml(node: Node) -> Any:
    nvml = node.mock
    nvml.nvmlInit()
    return nvml


def _admin_gpu_instance(node: Node, device: str) -> int:
    """An administrator's half-made MIG device: a GPU instance at the device's
    placement (`nvidia-smi mig -cgi`), its compute instance not yet made."""
    target = _target(node, device)
    nvml = _with_nvml(node)
    try:
        gpu = nvml.nvmlDeviceGetHandleByUUID(target.gpu_uuid)
        placement = nvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = target.placement
        gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            gpu, target.profile_id, ctypes.byref(placement)
        )
        return int(nvml.nvmlGpuInstanceGetInfo(gi).id)
    finally:
        nvml.nvmlShutdown()


def _admin_compute_instance(nvml: Any, gi: Any) -> None:
    """The administrator's second step (`nvidia-smi mig -cci`), in an NVML session."""
    covering = max(ci_profiles(nvml, gi), key=lambda info: int(info.sliceCount))
    nvml.nvmlGpuInstanceCreateComputeInstance(gi, int(covering.id))


def _finish_admin_device(node: Node, gpu_uuid: str, gi_id: int) -> None:
    nvml = _with_nvml(node)
    try:
        gpu = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        _admin_compute_instance(nvml, nvml.nvmlDeviceGetGpuInstanceById(gpu, gi_id))
    finally:
        nvml.nvmlShutdown()


def _bare(node: Node) -> list[tuple[int, tuple[int, int]]]:
    """The GPU instances without a compute instance: (id, placement)."""
    return [(m.gi_id, m.placement) for m in node.live() if m.ci_id is None]


@pytest.fixture
def refused(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """GPU-instance ids whose destroy NVML refuses, every time, while listed."""
    ids: set[int] = set()
    real = MigManager.destroy

    def destroy(
        self: MigManager, gpu_uuid: str, gi_id: int, recorded: RecordedInstance | None = None
    ) -> bool:
        if gi_id in ids:
            raise MigError("NVML refused", code="NVML_ERROR_UNKNOWN", retryable=True)
        return real(self, gpu_uuid, gi_id, recorded)

    monkeypatch.setattr(MigManager, "destroy", destroy)
    return ids


def _teardown_stuck_on_the_second(node: Node, refused: set[int]) -> MigInstance:
    """Claim u holds two MIG devices; its unprepare destroyed the first and NVML keeps
    refusing the second: the entry, and both records, stay (the claim is owed)."""
    ref = node.claims.add("u", *TWO)
    assert node.state.prepare([ref])["u"].ok
    first, second = sorted(node.live(), key=lambda m: m.placement)
    refused.add(second.gi_id)
    error = node.state.unprepare([node.claims.add("u")])["u"]
    assert error is not None
    assert node.live() == [second]
    return first


def _other_requests(node: Node) -> None:
    """An unrelated prepare and unprepare on the node; each retries the owed teardown."""
    assert node.state.prepare([node.claims.add("v", OTHER)])["v"].ok
    assert node.state.unprepare([node.claims.add("v")]) == {"v": None}
    assert node.state.unprepare([node.claims.add("u")])["u"] is not None  # still refused


def test_a_failing_teardown_never_destroys_a_gpu_instance_made_at_a_placement_it_freed(
    tmp_path: Path, refused: set[int]
) -> None:
    """The claim's first device is destroyed, the second keeps failing. An
    administrator sees the first placement free and starts a MIG device there. No
    later prepare or unprepare on the node, nor the claim's own retries, destroys it:
    this process destroyed the recorded device, so what is at its ids is not it."""
    node = make_node(tmp_path, H100)
    first = _teardown_stuck_on_the_second(node, refused)
    admin = _admin_gpu_instance(node, TWO[0])
    assert admin == first.gi_id  # the recorded ids: a GPU instance's id follows its placement
    _other_requests(node)
    assert _bare(node) == [(admin, first.placement)]

    refused.clear()  # NVML lets the second go: the claim's teardown finishes
    assert node.state.unprepare([node.claims.add("u")]) == {"u": None}
    assert Checkpoint(tmp_path / "plugin").load() == {}
    assert _bare(node) == [(admin, first.placement)]
    _finish_admin_device(node, first.gpu_uuid, admin)  # the administrator's device works
    (made,) = node.live()
    assert made.gi_id == admin and made.uuid is not None and made.uuid != first.uuid


def test_a_recorded_device_found_gone_is_not_looked_for_again(
    tmp_path: Path, refused: set[int]
) -> None:
    """An administrator destroyed the claim's first device by hand while its teardown
    kept failing on the second; the retries found it gone. A GPU instance made at its
    placement afterwards is the administrator's."""
    node = make_node(tmp_path, H100)
    ref = node.claims.add("u", *TWO)
    assert node.state.prepare([ref])["u"].ok
    first, second = sorted(node.live(), key=lambda m: m.placement)
    refused.add(second.gi_id)
    assert node.backend.mig().destroy(first.gpu_uuid, first.gi_id)  # nvidia-smi -dci -dgi
    assert node.state.unprepare([node.claims.add("u")])["u"] is not None  # finds it gone
    admin = _admin_gpu_instance(node, TWO[0])
    assert admin == first.gi_id
    _other_requests(node)
    assert _bare(node) == [(admin, first.placement)]


def test_a_compute_instance_made_between_the_check_and_the_destroy_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim's device is gone and a GPU instance without a compute instance sits at
    its ids: the rule takes it for what is left of the claim's. The administrator who
    is making it creates its compute instance just after the check. Its destroy then
    finds the GPU instance in use: the MIG device there is not the claim's, and it is
    left running; the claim's teardown is done."""
    node = make_node(tmp_path, H100)
    assert node.state.prepare([node.claims.add("u", TWO[0])])["u"].ok
    (mine,) = node.live()
    assert node.backend.mig().destroy(mine.gpu_uuid, mine.gi_id)  # by hand
    admin = _admin_gpu_instance(node, TWO[0])
    assert admin == mine.gi_id

    real = mig_module.compute_instances
    raced: list[int] = []

    def admin_right_after_the_check(nvml: Any, gi: Any) -> list[Any]:
        found = real(nvml, gi)
        if not found and not raced:
            raced.append(int(nvml.nvmlGpuInstanceGetInfo(gi).id))
            _admin_compute_instance(nvml, gi)
        return found

    monkeypatch.setattr(mig_module, "compute_instances", admin_right_after_the_check)
    assert node.state.unprepare([node.claims.add("u")]) == {"u": None}
    assert raced == [admin]
    assert Checkpoint(tmp_path / "plugin").load() == {}
    (made,) = node.live()
    assert (made.gi_id, made.placement) == (admin, mine.placement)
    assert made.ci_id is not None and made.uuid is not None and made.uuid != mine.uuid


def test_in_use_without_a_compute_instance_is_tried_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML answers IN_USE once for the GPU instance a killed teardown left, and it
    still holds no compute instance (not a MIG device someone made there): its
    destroy is tried once more, as before, and the claim's teardown finishes."""
    node = make_node(tmp_path, H100)
    assert node.state.prepare([node.claims.add("u", TWO[0])])["u"].ok
    (mine,) = node.live()
    _strip_compute_instance(node, mine)
    mock = node.mock
    real = mock.nvmlGpuInstanceDestroy
    busy = [mock.NVMLError(mock.NVML_ERROR_IN_USE)]

    def in_use_once(gi: Any) -> int:
        if busy:
            raise busy.pop()
        return real(gi)  # type: ignore[no-any-return]

    monkeypatch.setattr(mock, "nvmlGpuInstanceDestroy", in_use_once)
    assert node.state.unprepare([node.claims.add("u")]) == {"u": None}
    assert busy == []
    assert node.live() == []


# -- what stays: the claim's own leftover is destroyed ---------------------------------


def _strip_compute_instance(node: Node, mine: MigInstance) -> None:
    """A teardown killed (or refused) between its two destroys: the GPU instance at the
    recorded ids, without its compute instance."""
    nvml = _with_nvml(node)
    try:
        gpu = nvml.nvmlDeviceGetHandleByUUID(mine.gpu_uuid)
        gi = nvml.nvmlDeviceGetGpuInstanceById(gpu, mine.gi_id)
        nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(gi, mine.ci_id))
    finally:
        nvml.nvmlShutdown()


def test_a_teardown_refused_between_its_two_destroys_finishes_at_the_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML destroys the compute instance and refuses the GPU instance: the retry finds
    the GPU instance without a compute instance and destroys it, so the placement is
    not held for good."""
    node = make_node(tmp_path, H100)
    assert node.state.prepare([node.claims.add("u", TWO[0])])["u"].ok
    (mine,) = node.live()
    mock = node.mock
    real = mock.nvmlGpuInstanceDestroy
    refusals = [mock.NVMLError(mock.NVML_ERROR_UNKNOWN)]

    def refused_once(gi: Any) -> int:
        if refusals:
            raise refusals.pop()
        return real(gi)  # type: ignore[no-any-return]

    monkeypatch.setattr(mock, "nvmlGpuInstanceDestroy", refused_once)
    assert node.state.unprepare([node.claims.add("u")])["u"] is not None
    assert _bare(node) == [(mine.gi_id, mine.placement)]
    # The next request on the node finishes the owed teardown.
    assert node.state.prepare([node.claims.add("v", OTHER)])["v"].ok
    assert sorted(Checkpoint(tmp_path / "plugin").load()) == ["v"]
    assert [m.placement for m in node.live()] == [_target(node, OTHER).placement]
