"""A MIG listing races the destroys that run outside the node lock (an unprepare in
flight, a rolling update's old instance, an administrator): an instance listed a
moment ago is gone when it is read. The listing is taken again; nothing fails.

The destroy here happens right after `nvmlDeviceGetGpuInstances` returned the
instance, as another process's destroy would: reading the listed handle then fails as
NVML fails a stale handle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from driver.nvml.mig.mig_errors import MigError
from driver.nvml.mig.mig_listing import LISTING_ATTEMPTS, InstanceVanished, retried
from driver.nvml.mock.nvml import MockNvml
from driver.state.journal.checkpoint import Checkpoint
from tests.unit.test_mig_foreign import _target
from tests.unit.test_mig_prepare import H100, Node, make_node


def _destroyed_under_the_next_listing(mock: MockNvml, gi_id: int) -> list[int]:
    """Once a listing of GPU 0 returns GPU instance `gi_id`, destroy it (with its
    compute instances) before anything of it is read. Returns a list that gets the
    id once that happened."""
    real = mock.nvmlDeviceGetGpuInstances
    done: list[int] = []

    def listing(device: Any, profile_id: int, array: Any, count: Any) -> int:
        result = real(device, profile_id, array, count)
        gpu = mock.gpus[0].uuid
        with mock.mig_store.open() as st:
            target = [gi for gi in st.gpus.get(gpu, []) if gi.id == gi_id]
            if not done and target and target[0].profile == profile_id:  # it was listed
                st.gpus[gpu].remove(target[0])
                done.append(gi_id)
        return int(result)

    mock.nvmlDeviceGetGpuInstances = listing  # type: ignore[method-assign]
    return done


def _prepared(node: Node, uid: str, device: str) -> int:
    res = node.state.prepare([node.claims.add(uid, device)])[uid]
    assert res.ok, res.error
    record = res.devices[0].mig
    assert record is not None and record.gi_id is not None
    return record.gi_id


def test_a_prepare_whose_occupant_check_races_a_destroy_succeeds(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100)
    leaving = _prepared(node, "old", "gpu-0-mig-1g10gb-0")
    done = _destroyed_under_the_next_listing(node.mock, leaving)
    res = node.state.prepare([node.claims.add("new", "gpu-0-mig-1g10gb-1")])["new"]
    assert done == [leaving]
    assert res.ok, res.error


def test_discovery_takes_the_listing_again_when_an_instance_vanishes(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100)
    admin = node.backend.mig().create(_target(node, "gpu-0-mig-1g10gb-4"))
    stays = node.backend.mig().create(_target(node, "gpu-0-mig-3g40gb-0"))
    done = _destroyed_under_the_next_listing(node.mock, admin.gi_id)
    inventory = node.backend.discover()
    assert done == [admin.gi_id]
    assert inventory.gpus[0].mig_instances == (stays,)


def test_recovery_reports_no_problem_when_a_foreign_instance_vanishes(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100)
    _prepared(node, "mine", "gpu-0-mig-1g10gb-0")
    journal = Checkpoint(tmp_path / "plugin").load()
    admin = node.backend.mig().create(_target(node, "gpu-0-mig-1g10gb-5"))
    done = _destroyed_under_the_next_listing(node.mock, admin.gi_id)
    report = node.state.recover()
    assert done == [admin.gi_id]
    assert report.problems == ()
    assert Checkpoint(tmp_path / "plugin").load() == journal


def test_a_layout_that_keeps_changing_is_a_transient_error_after_a_few_listings() -> None:
    attempts: list[int] = []

    def always_vanishing() -> None:
        attempts.append(1)
        raise InstanceVanished("NVML_ERROR_INVALID_ARGUMENT", "Invalid Argument")

    with pytest.raises(MigError) as err:
        retried("listing the MIG devices of GPU-x", always_vanishing)
    assert len(attempts) == LISTING_ATTEMPTS
    assert err.value.retryable and "a retry succeeds" in str(err.value)
