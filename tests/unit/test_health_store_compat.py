"""HealthStore across releases: a downgrade never forgets what a newer release recorded."""

from __future__ import annotations

import json
from pathlib import Path

from driver.cli.state_dir import read_health
from driver.health.store import HealthStore
from tests.taints import untimed
from tests.unit.test_health_store import DEVICES, GPU0, GPU1

NEWER_KIND_RECORD = {
    "key": "gpu.example.com/ecc-row-remap",
    "value": "pending",
    "reason": "row remap pending",
    "since": "2026-01-02T03:04:05Z",
}


def test_unknown_failure_kind_is_kept_and_taints_its_gpu(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    path.write_text(json.dumps({"version": 1, "gpus": {GPU0: NEWER_KIND_RECORD}}))
    store = HealthStore(path)
    assert store.problem is None
    taints = untimed(store.device_taints(DEVICES))
    expected = [
        {"key": "gpu.example.com/ecc-row-remap", "value": "pending", "effect": "NoSchedule"}
    ]
    assert {name: t for name, t in taints.items()} == {
        "gpu-0": expected,
        "gpu-0-mig-1g10gb-0": expected,
        "gpu-0-mig-3g40gb-4": expected,
    }
    assert not store.record_xid(GPU0, 79)  # never replaces what it cannot rank
    assert store.record_xid(GPU1, 79)  # a rewrite keeps the unknown record
    assert json.loads(path.read_text())["gpus"][GPU0] == NEWER_KIND_RECORD


def test_store_of_a_newer_version_is_kept_untouched_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    newer = json.dumps({"version": 2, "gpus": {}, "quarantined": {GPU0: {}}})
    path.write_text(newer)
    store = HealthStore(path)
    assert store.problem is not None
    assert "newer release" in store.problem and "version 2" in store.problem
    assert store.tainted_device_count(DEVICES) == len(DEVICES)  # fails closed
    store.record_xid(GPU1, 79)
    assert path.read_text() == newer


def test_gpu_dra_names_a_store_of_a_newer_release(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    path.write_text(json.dumps({"version": 2, "gpus": {}}))
    view = read_health(tmp_path)
    assert view.store is None and view.unknown is not None
    assert view.unknown.startswith(
        f"{path} was written by a newer release (schema version 2; this release reads up to 1)"
    )
