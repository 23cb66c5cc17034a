"""A MIG device is the claim's only while it has the UUID the journal recorded.

On the NVIDIA driver a GPU instance's id follows its placement and the first compute
instance is 0, so a device created again at the claim's profile and placement by
anyone (an administrator in this boot, mig-parted's boot-time layout after a reboot)
has the recorded ids; only its UUID differs. Such a device is reported, never
destroyed by the claim's unprepare and never adopted by the restart (docs/mig.md,
"Crash safety")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver.nvml.discovered import MigInstance
from driver.nvml.mock.mock_api import NVML_ERROR_NOT_FOUND, NVMLError
from driver.state.journal.checkpoint import Checkpoint, ClaimEntry, ClaimState
from driver.state.journal.journal_entries import boot_id
from tests.unit.test_mig_foreign import _intent, _target
from tests.unit.test_mig_owned import _published_uuids
from tests.unit.test_mig_prepare import H100, Node, make_node

DEVICE = "gpu-0-mig-2g20gb-2"


def _prepared(node: Node, uid: str) -> MigInstance:
    assert node.state.prepare([node.claims.add(uid, DEVICE)])[uid].ok
    (mine,) = node.live()
    return mine


def _created_again(node: Node, mine: MigInstance) -> MigInstance:
    again = node.backend.mig().create(_target(node, DEVICE))
    assert (again.gi_id, again.ci_id, again.placement) == (mine.gi_id, mine.ci_id, mine.placement)
    assert again.uuid != mine.uuid
    return again


def test_unprepare_leaves_a_device_created_again_at_the_claims_placement(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100)
    mine = _prepared(node, "u")
    assert node.backend.mig().destroy(mine.gpu_uuid, mine.gi_id)  # nvidia-smi, a GPU reset
    admin = _created_again(node, mine)
    assert node.state.unprepare([node.claims.add("u")]) == {"u": None}
    assert node.live() == [admin]
    assert Checkpoint(tmp_path / "plugin").load() == {}


def test_a_restart_after_a_reboot_never_adopts_the_boot_layouts_device(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100)
    mine = _prepared(node, "r")
    journal = Checkpoint(tmp_path / "plugin").load()
    node.mock.mock_reboot()
    boot_layout = _created_again(node, mine)

    restarted = make_node(tmp_path, H100)
    report = restarted.state.recover()
    assert [p.split(":")[0] for p in report.problems] == ["r"]
    assert boot_layout.uuid is not None and boot_layout.uuid in report.problems[0]
    assert Checkpoint(tmp_path / "plugin").load() == journal  # the recorded UUID kept
    assert boot_layout.uuid in _published_uuids(restarted)  # foreign: a static device
    assert restarted.state.unprepare([restarted.claims.add("r")]) == {"r": None}
    assert restarted.live() == [boot_layout]
    assert Checkpoint(tmp_path / "plugin").load() == {}


def test_an_intent_of_an_earlier_boot_destroys_nothing_at_its_placement(tmp_path: Path) -> None:
    """A crash between the intent and the create, then a reboot whose boot-time layout
    put a device at the intent's placement: that device did not exist when the intent
    was journaled (its id is not in `before`), yet nothing an attempt of another boot
    made survives a reboot. The intent records its boot; its rollback leaves the
    device, and discovery does not count it as the journal's."""
    node = make_node(tmp_path, H100)
    mine = _prepared(node, "r")
    cp = Checkpoint(tmp_path / "plugin")
    (device,) = cp.load()["r"].devices
    cp.store(
        {
            "r": ClaimEntry(
                ClaimState.PREPARE_STARTED,
                "default",
                "claim-r",
                (_intent(device, before=[], boot="an-earlier-boot"),),
            )
        }
    )
    node.mock.mock_reboot()
    boot_layout = _created_again(node, mine)
    restarted = make_node(tmp_path, H100)  # recover() rolls the intent back
    assert restarted.live() == [boot_layout]
    assert cp.load() == {}
    assert boot_layout.uuid in _published_uuids(restarted)


def _compute_instance_destroyed(node: Node, mine: MigInstance) -> None:
    """What a teardown killed between its two destroys leaves: the GPU instance at the
    recorded ids, without the compute instance (and so without the MIG device)."""
    nvml = node.mock
    nvml.nvmlInit()
    try:
        gpu = nvml.nvmlDeviceGetHandleByUUID(mine.gpu_uuid)
        gi = nvml.nvmlDeviceGetGpuInstanceById(gpu, mine.gi_id)
        assert mine.ci_id is not None
        nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(gi, mine.ci_id))
    finally:
        nvml.nvmlShutdown()
    (bare,) = node.live()
    assert (bare.gi_id, bare.ci_id, bare.uuid) == (mine.gi_id, None, None)


def test_the_kubelets_retry_destroys_the_gpu_instance_a_killed_unprepare_left(
    tmp_path: Path,
) -> None:
    """A GPU instance without any compute instance holds no MIG device: nothing runs
    on it, so at the recorded ids, profile and placement it is the claim's, what is
    left of it. Left alone, the GPU's placement stays taken for good."""
    node = make_node(tmp_path, H100)
    mine = _prepared(node, "u")
    _compute_instance_destroyed(node, mine)
    assert node.state.unprepare([node.claims.add("u")]) == {"u": None}
    assert node.live() == []
    assert Checkpoint(tmp_path / "plugin").load() == {}


def test_a_restart_finishes_an_unprepare_killed_between_the_two_destroys(
    tmp_path: Path,
) -> None:
    node = make_node(tmp_path, H100)
    mine = _prepared(node, "u")
    cp = Checkpoint(tmp_path / "plugin")
    entry = cp.load()["u"]
    cp.store({"u": replace(entry, unpreparing=boot_id())})  # the teardown had begun:
    assert node.state.cdi.remove_claim_spec("u")  # the spec goes before the MIG device
    _compute_instance_destroyed(node, mine)

    restarted = make_node(tmp_path, H100)  # recover() finishes the unprepare
    assert restarted.live() == []
    assert cp.load() == {}
    assert "gpu-0" in restarted.state.devices  # the GPU is whole again, not static


def test_a_gpu_instance_the_claim_lost_its_compute_instance_from_stays_the_claims(
    tmp_path: Path,
) -> None:
    """An administrator destroyed only the compute instance of a prepared claim's device:
    at the restart the bare GPU instance is still the journal's, so the GPU does not
    turn static under `auto`; the claim's device is created again, as after a reboot."""
    node = make_node(tmp_path, H100)
    mine = _prepared(node, "u")
    _compute_instance_destroyed(node, mine)
    restarted = make_node(tmp_path, H100)  # recover() creates the device again whole
    assert DEVICE in restarted.state.devices  # still published: the GPU stays dynamic
    (again,) = restarted.live()
    (device,) = Checkpoint(tmp_path / "plugin").load()["u"].devices
    assert device.mig is not None and device.mig.uuid == again.uuid != mine.uuid
    assert again.uuid in str(restarted.spec("u"))
    assert restarted.state.unprepare([restarted.claims.add("u")]) == {"u": None}
    assert restarted.live() == []


def test_unprepare_never_reports_success_while_the_uuid_lookup_misses_its_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML's lookup by the recorded MIG UUID answers NOT_FOUND while the device still
    runs at the recorded ids. The device is the claim's (its UUID, read at its ids, is
    the recorded one): unprepare destroys it. Reporting success and keeping it would
    leak it (the next start makes its GPU static, or refuses to start)."""
    node = make_node(tmp_path, H100)
    mine = _prepared(node, "u")
    lookup = node.mock.nvmlDeviceGetHandleByUUID

    def misses_mine(uuid: str | bytes) -> Any:
        if (uuid.decode() if isinstance(uuid, bytes) else uuid) == mine.uuid:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return lookup(uuid)

    monkeypatch.setattr(node.mock, "nvmlDeviceGetHandleByUUID", misses_mine)
    assert node.state.unprepare([node.claims.add("u")]) == {"u": None}
    assert node.live() == []
    assert Checkpoint(tmp_path / "plugin").load() == {}
