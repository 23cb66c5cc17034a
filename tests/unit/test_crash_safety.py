"""Kill -9 at every failpoint of prepare/unprepare, restart, check the state.

A subprocess runs DeviceState with file-based fakes and `GPU_DRA_FAILPOINTS=<name>`;
it must die by SIGKILL at that point. The test then reruns in-process (a fresh
DeviceState, as after a plugin restart) and checks that exactly the right CDI spec
files and checkpoint entries exist, that nothing leaked (temp files) and that no
device is double-booked. The test parametrizes over `FAILPOINTS`, so a new failpoint
without a scenario here fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from driver.failpoints import ENV_VAR, FAILPOINTS, PREPARE_FAILPOINTS, UNPREPARE_FAILPOINTS
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.journal.journal_entries import unprepare_begun
from driver.state.prepare import DeviceState
from driver.state.request import ClaimRef

HARNESS = r"""
import json
import os
import sys
from pathlib import Path

from driver.devices.model import PoolOptions, build_pool
from driver.errors import transient
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.nvml import MockNvml
from driver.state.request import ClaimRef
from driver.state.prepare import DeviceState

PROC_DEVICES = Path(__import__("driver").__file__).parents[1] / "tests/unit/data/proc-devices"
FLEET = parse_fleet(
    {
        "gpus": [
            {"model": "H100-80GB", "count": 3},
            {"model": "H100-80GB", "count": 1, "migMode": "disabled"},
        ]
    }
)
# gpu-0..2 in dynamic MIG mode: gpu-N is backed by a full-size MIG device, the
# partitions by theirs; all are created at prepare and destroyed at unprepare.
# gpu-3 (MIG off) is shared by consumable capacity.
DEVICES = {
    d.name: d
    for d in build_pool(
        MockBackend(MockNvml(FLEET, "node-a")).discover(),
        PoolOptions(allow_multiple_allocations=True),
    ).devices
}


def nvml(root):
    # The node's GPUs: MIG state lives under the driver root, like a real GPU's.
    return MockBackend(MockNvml(FLEET, "node-a", driver_root=Path(root) / "driver-root"))


class FileClaims:
    def __init__(self, root):
        self.path = Path(root) / "claims.json"

    def get(self, namespace, name):
        claims = json.loads(self.path.read_text())
        key = f"{namespace}/{name}"
        if key not in claims:
            raise transient(f"{key} not found")
        return claims[key]


class Healthy:
    def failure(self, device_name):
        return None

    def ensure_tainted(self, device_name):
        raise AssertionError("no device is failed here")


class NoReports:
    def permanent_failure(self, claim, error):
        raise AssertionError(f"unexpected permanent error: {error}")


def build_state(root):
    root = Path(root)
    return DeviceState(
        driver_name="gpu.example.com",
        node_name="node-a",
        devices=DEVICES,
        cdi_root=root / "cdi",
        data_dir=root / "plugin",
        claims=FileClaims(root),
        health=Healthy(),
        reporter=NoReports(),
        real_devices=True,
        mig=nvml(root).mig(),
        caps_root=root / "driver-root",
        proc_devices=PROC_DEVICES,
        # Node MPS daemons (the mock's stand-in): shares of gpu-3 get one each.
        mps=nvml(root).mps("/unused") if os.environ.get("GPU_DRA_CRASH_MPS") else None,
    )


def refs(root, names):
    claims = json.loads((Path(root) / "claims.json").read_text())
    out = []
    for key in names:
        namespace, name = key.split("/")
        out.append(ClaimRef(namespace, name, claims[key]["metadata"]["uid"]))
    return out


def main():
    root, op, *names = sys.argv[1:]
    state = build_state(root)
    if op == "prepare":
        res = state.prepare(refs(root, names))
        out = {uid: (None if r.error is None else str(r.error)) for uid, r in res.items()}
    else:
        res = state.unprepare(refs(root, names))
        out = {uid: (None if e is None else str(e)) for uid, e in res.items()}
    print(json.dumps(out))
"""

_NS: dict[str, Any] = {"__name__": "crash_harness"}
exec(compile(HARNESS, "crash_harness", "exec", dont_inherit=True), _NS)


def _config(sharing: dict[str, Any], requests: list[str]) -> dict[str, Any]:
    return {
        "source": "FromClaim",
        "requests": requests,
        "opaque": {
            "driver": "gpu.example.com",
            "parameters": {
                "apiVersion": "gpu.resource.example.com/v1alpha1",
                "kind": "GpuConfig",
                "sharing": sharing,
            },
        },
    }


def _claim(uid: str, name: str, results: list[tuple[str, str]], configs: list[Any]) -> Any:
    return {
        "metadata": {"namespace": "default", "name": name, "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": r, "driver": "gpu.example.com", "pool": "node-a", "device": d}
                        for r, d in results
                    ],
                    "config": configs,
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["node-a"]}
                            ]
                        }
                    ]
                },
            }
        },
    }


CLAIMS = {
    # Two devices, two configs: a GPU space-partitioned and a MIG partition.
    "default/claim-a": _claim(
        "0a0a0a0a-0000-4000-8000-00000000000a",
        "claim-a",
        [("train", "gpu-0"), ("infer/small", "gpu-1-mig-2g20gb-0")],
        [
            _config(
                {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 2}},
                ["train"],
            ),
            # No interval: these GPUs are in MIG mode, where none can be set (refused).
            _config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Default"}}, []),
        ],
    ),
    # Wants gpu-0 as well: must never be prepared while claim-a holds it.
    "default/claim-b": _claim(
        "0b0b0b0b-0000-4000-8000-00000000000b", "claim-b", [("gpu", "gpu-0")], []
    ),
    # Prepared together with claim-a in one request (the batch tests).
    "default/claim-c": _claim(
        "0c0c0c0c-0000-4000-8000-00000000000c", "claim-c", [("gpu", "gpu-2")], []
    ),
}


def _share(uid: str, name: str, share_id: str) -> Any:
    """A share of gpu-3: 16Gi of its memory and 20 of its compute."""
    claim = _claim(uid, name, [("gpu", "gpu-3")], [])
    claim["status"]["allocation"]["devices"]["results"][0].update(
        shareID=share_id, consumedCapacity={"memory": "16Gi", "compute": "20"}
    )
    return claim


SHARE_1, SHARE_2 = "default/share-1", "default/share-2"
CLAIMS[SHARE_1] = _share("05050505-0000-4000-8000-000000000001", "share-1", "s-1")
CLAIMS[SHARE_2] = _share("05050505-0000-4000-8000-000000000002", "share-2", "s-2")
UID_S1 = CLAIMS[SHARE_1]["metadata"]["uid"]
UID_S2 = CLAIMS[SHARE_2]["metadata"]["uid"]
UID_A = CLAIMS["default/claim-a"]["metadata"]["uid"]
UID_B = CLAIMS["default/claim-b"]["metadata"]["uid"]
UID_C = CLAIMS["default/claim-c"]["metadata"]["uid"]
BATCH = ("default/claim-a", "default/claim-c")

# How each failpoint is reached. A new failpoint needs an entry here.
SCENARIOS: dict[str, str] = {
    **{name: "prepare" for name in PREPARE_FAILPOINTS},
    "prepare-rollback-after-cdi-removed": "prepare-retry",
    **{name: "unprepare" for name in UNPREPARE_FAILPOINTS},
}
# State after a crash and `recover()` of claims without MIG devices (the shares of
# gpu-3); failpoints not listed: nothing left.
RECOVERED_SHARES = {
    "prepare-after-completed": "prepared",
    "unprepare-before-cdi-removed": "prepared",
    "unprepare-after-cdi-removed": "entry-without-spec",
    "unprepare-entry-before-commit": "entry-without-spec",
}
# The same for claim-a (and claim-c), which hold MIG devices the driver created: their
# unprepare marks the entries `unpreparing` before it removes anything, and a restart
# in the same boot that finds a marked entry's spec gone finishes the teardown instead
# of creating the MIG devices again.
RECOVERED = {
    "prepare-after-completed": "prepared",
    "unprepare-before-cdi-removed": "prepared",  # nothing removed yet: the kubelet repeats
    **{name: "torn-down" for name in UNPREPARE_FAILPOINTS[1:-1]},
}
# A journal store killed before its commit (the append, or the snapshot's rename)
# shows nothing of it: the claim-a entries' states as the step before left them.
BEFORE_COMMIT = {
    "prepare-started-before-commit": set(),
    "prepare-completed-before-commit": {ClaimState.PREPARE_STARTED},
    "unprepare-entry-before-commit": {ClaimState.PREPARE_COMPLETED},
}


def _root(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    root.mkdir()
    (root / "claims.json").write_text(json.dumps(CLAIMS))
    return root


def _state(root: Path) -> DeviceState:
    state = _NS["build_state"](root)
    assert isinstance(state, DeviceState)
    return state


def _ref(key: str) -> ClaimRef:
    doc = CLAIMS[key]["metadata"]
    return ClaimRef(doc["namespace"], doc["name"], doc["uid"])


def _crash(
    root: Path, op: str, failpoint: str, names: tuple[str, ...] = ("default/claim-a",)
) -> None:
    env = {**os.environ, ENV_VAR: failpoint}
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS + "\nmain()\n", str(root), op, *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"{op} did not die at {failpoint}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )


def _temp_files(root: Path) -> list[str]:
    return sorted(
        p.name
        for d in (root / "cdi", root / "plugin")
        if d.exists()
        for p in d.iterdir()
        if ".tmp-" in p.name
    )


def _claim_specs(root: Path) -> dict[str, bytes]:
    cdi = root / "cdi"
    if not cdi.exists():
        return {}
    return {
        p.name: p.read_bytes()
        for p in cdi.iterdir()
        if p.name.endswith(".json") and not p.name.endswith("_common.json")
    }


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What an uninterrupted prepare of claim-a produces."""
    root = _root(tmp_path_factory.mktemp("golden"), "root")
    state = _state(root)
    res = state.prepare([_ref("default/claim-a")])[UID_A]
    assert res.ok, res.error
    assert len(_live_mig(root)) == 2  # gpu-0's full-size device and the 2g partition
    return {
        "devices": res.devices,
        "specs": _claim_specs(root),
        "journal": Checkpoint(root / "plugin").load(),
        "mig": _live_mig(root),
    }


def _live_mig(root: Path) -> set[tuple[str, int, tuple[int, int], str | None]]:
    backend = _NS["nvml"](root)
    return {
        (m.gpu_uuid, m.gi_id, m.placement, m.uuid)
        for gpu in backend.module.gpus
        if gpu.mig_enabled
        for m in backend.mig().instances(gpu.uuid)
    }


def _owned_mig(root: Path) -> set[tuple[str, int, tuple[int, int], str | None]]:
    return {
        (d.mig.gpu_uuid, d.mig.gi_id, d.mig.placement, d.mig.uuid)
        for e in Checkpoint(root / "plugin").load().values()
        for d in e.devices
        if d.mig is not None and d.mig.owned and d.mig.gi_id is not None
    }


_MIG_UUID = re.compile(r"MIG-[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}")


def _masked(value: Any) -> str:
    """`value` as text with every MIG UUID masked, to compare with an uninterrupted
    run: a MIG device rolled back and created again at its placement gets the same
    ids and a new UUID, as on a GPU."""
    if isinstance(value, set):
        value = sorted(value)
    return _MIG_UUID.sub("MIG-*", repr(value))


def _assert_prepared_exactly_once(root: Path, golden: dict[str, Any]) -> None:
    assert _masked(_claim_specs(root)) == _masked(golden["specs"])
    assert _masked(Checkpoint(root / "plugin").load()) == _masked(golden["journal"])
    assert _temp_files(root) == []
    # Every MIG device belongs to a completed claim, and every one of those exists.
    assert _live_mig(root) == _owned_mig(root)
    assert _masked(_live_mig(root)) == _masked(golden["mig"])


def _assert_empty(root: Path) -> None:
    assert _claim_specs(root) == {}
    assert Checkpoint(root / "plugin").load() == {}
    assert _temp_files(root) == []
    assert _live_mig(root) == set(), "a MIG device leaked"


def test_every_failpoint_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(FAILPOINTS)
    assert len(FAILPOINTS) == len(set(FAILPOINTS))


def test_failpoints_are_documented() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "state.md").read_text()
    missing = [name for name in FAILPOINTS if f"`{name}`" not in doc]
    assert missing == []


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_kill_at_failpoint_then_restart(
    failpoint: str, tmp_path: Path, golden: dict[str, Any]
) -> None:
    scenario = SCENARIOS[failpoint]
    root = _root(tmp_path, "node")
    claim_a, claim_b = _ref("default/claim-a"), _ref("default/claim-b")

    if scenario == "unprepare":
        assert _state(root).prepare([claim_a])[UID_A].ok
        _crash(root, "unprepare", failpoint)
    else:
        if scenario == "prepare-retry":
            _crash(root, "prepare", "prepare-after-cdi")  # leaves a half-done prepare
        _crash(root, "prepare", failpoint)

    # Whatever the crash left, claim-a's devices are never handed to claim-b while
    # claim-a has any state on the node. An unprepare of claim-a that had begun (the
    # kubelet asked; its spec is gone) is finished first, as a restart would.
    journal_after_crash = Checkpoint(root / "plugin").load()
    if failpoint in BEFORE_COMMIT:
        states = {e.state for e in journal_after_crash.values()}
        assert states == BEFORE_COMMIT[failpoint], "the store's content became visible"
    if UID_A in journal_after_crash:
        other = _state(_copy(root, tmp_path / "b"))
        spec_exists = other.cdi.claim_spec_exists(UID_A)
        blocked = other.prepare([claim_b])[UID_B]
        if unprepare_begun(journal_after_crash[UID_A], spec_exists):
            assert blocked.ok, blocked.error
            assert UID_A not in Checkpoint(tmp_path / "b" / "plugin").load()
        else:
            assert blocked.error is not None and UID_A in str(blocked.error)

    # The startup path: leftovers cleaned, no PrepareStarted survives.
    recovered = _copy(root, tmp_path / "recover")
    report = _state(recovered).recover()
    assert report.checkpoint_problem is None and report.orphan_specs == ()
    journal = Checkpoint(recovered / "plugin").load()
    assert all(e.state is ClaimState.PREPARE_COMPLETED for e in journal.values())
    assert _temp_files(recovered) == []
    expected = RECOVERED.get(failpoint, "empty")
    if expected == "prepared":
        _assert_prepared_exactly_once(recovered, golden)
        assert report.missing_specs == ()
    elif expected == "torn-down":
        # The kubelet asked to unprepare (the entry says so): the restart finishes it,
        # and creates no MIG device for a claim being torn down.
        _assert_empty(recovered)
        assert report.finished_unprepares == (UID_A,) and report.recreated_specs == ()
        assert report.restored_mig == () and report.problems == ()
    else:
        _assert_empty(recovered)
        assert report.rolled_back in ((), (UID_A,)) and report.finished_unprepares == ()

    if scenario == "unprepare":
        # The kubelet repeats the unprepare after the restart.
        assert _state(root).unprepare([claim_a]) == {UID_A: None}
        _assert_empty(root)
    else:
        # The kubelet may give up on the pod: unprepare cleans everything.
        given_up = _copy(root, tmp_path / "given-up")
        assert _state(given_up).unprepare([claim_a]) == {UID_A: None}
        _assert_empty(given_up)
        # Or it retries the prepare: completed exactly once, same answer as uninterrupted.
        res = _state(root).prepare([claim_a])[UID_A]
        assert res.ok, res.error
        assert _masked(res.devices) == _masked(golden["devices"])
        _assert_prepared_exactly_once(root, golden)
        # Retrying again is idempotent.
        again = _state(root).prepare([claim_a])[UID_A].devices
        assert again == res.devices
        _assert_prepared_exactly_once(root, golden)
        assert _state(root).prepare([claim_b])[UID_B].error is not None  # still held
        assert _state(root).unprepare([claim_a]) == {UID_A: None}
        _assert_empty(root)

    # After the claim is gone its device is free again.
    assert _state(root).prepare([claim_b])[UID_B].ok


@pytest.fixture(scope="module")
def golden_batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What an uninterrupted prepare of claim-a and claim-c in one request produces."""
    root = _root(tmp_path_factory.mktemp("golden-batch"), "root")
    res = _state(root).prepare([_ref(key) for key in BATCH])
    assert all(r.ok for r in res.values()), res
    assert len(_live_mig(root)) == 3
    return {
        "devices": {uid: r.devices for uid, r in res.items()},
        "specs": _claim_specs(root),
        "journal": Checkpoint(root / "plugin").load(),
        "mig": _live_mig(root),
    }


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_kill_during_a_batch_then_restart(
    failpoint: str, tmp_path: Path, golden_batch: dict[str, Any]
) -> None:
    """The same failpoints at batch granularity: two claims in one request are always
    in the same state after a crash (one journal store covers both), and the retry of
    the request completes both exactly once."""
    scenario = SCENARIOS[failpoint]
    root = _root(tmp_path, "node")
    refs = [_ref(key) for key in BATCH]
    uids = sorted(r.uid for r in refs)
    if scenario == "unprepare":
        assert all(r.ok for r in _state(root).prepare(refs).values())
        _crash(root, "unprepare", failpoint, BATCH)
    else:
        if scenario == "prepare-retry":
            _crash(root, "prepare", "prepare-after-cdi", BATCH)
        _crash(root, "prepare", failpoint, BATCH)

    journal_after_crash = Checkpoint(root / "plugin").load()
    assert sorted(journal_after_crash) in ([], uids)  # one store wrote both entries
    assert len({e.state for e in journal_after_crash.values()}) <= 1

    recovered = _copy(root, tmp_path / "recover")
    report = _state(recovered).recover()
    assert report.checkpoint_problem is None and report.orphan_specs == ()
    assert _temp_files(recovered) == []
    journal = Checkpoint(recovered / "plugin").load()
    expected = RECOVERED.get(failpoint, "empty")
    if expected == "prepared":
        assert _masked(journal) == _masked(golden_batch["journal"])
        assert _masked(_claim_specs(recovered)) == _masked(golden_batch["specs"])
    elif expected == "torn-down":
        assert journal == {} and _claim_specs(recovered) == {}
        assert sorted(report.finished_unprepares) == uids and report.restored_mig == ()
    else:
        assert journal == {} and _claim_specs(recovered) == {}
        assert sorted(report.rolled_back) in ([], uids)
    live = _live_mig(recovered)
    assert live == _owned_mig(recovered), "MIG devices leaked or lost"
    assert _masked(live) == _masked(golden_batch["mig"] if journal else set())

    if scenario != "unprepare":  # the kubelet retries the request
        res = _state(root).prepare(refs)
        devices = {uid: r.devices for uid, r in res.items()}
        assert _masked(devices) == _masked(golden_batch["devices"])
        journal = Checkpoint(root / "plugin").load()
        assert _masked(journal) == _masked(golden_batch["journal"])
        specs = _claim_specs(root)
        assert _masked(specs) == _masked(golden_batch["specs"]) and _temp_files(root) == []
        assert _live_mig(root) == _owned_mig(root)
        assert _masked(_live_mig(root)) == _masked(golden_batch["mig"])
    assert _state(root).unprepare(refs) == dict.fromkeys(uids)
    _assert_empty(root)


def _copy(root: Path, target: Path) -> Path:
    shutil.copytree(root, target)
    return target


def test_two_plugin_instances_racing_for_one_device(tmp_path: Path) -> None:
    """A rolling update: two processes prepare conflicting claims at the same time.
    The serialize lock makes exactly one win; the journal and CDI specs agree."""
    root = _root(tmp_path, "node")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HARNESS + "\nmain()\n", str(root), "prepare", key],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key in ("default/claim-a", "default/claim-b")
    ]
    outputs: dict[str, str | None] = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        outputs.update(json.loads(stdout))
    winners = [uid for uid, err in outputs.items() if err is None]
    assert len(winners) == 1, outputs
    loser = UID_B if winners == [UID_A] else UID_A
    assert winners[0] in str(outputs[loser])  # refused, naming the holder
    journal = Checkpoint(root / "plugin").load()
    assert set(journal) == set(winners)
    assert journal[winners[0]].state is ClaimState.PREPARE_COMPLETED
    assert [name for name in _claim_specs(root)] == [f"k8s.gpu.example.com-gpu_{winners[0]}.json"]
    assert _temp_files(root) == []


def _share_state(root: Path, uid: str) -> tuple[dict[str, bytes], Any]:
    """A claim's CDI spec file(s), byte for byte, and its journal entry."""
    specs = {name: data for name, data in _claim_specs(root).items() if uid in name}
    return specs, Checkpoint(root / "plugin").load().get(uid)


# A share of a GPU with MIG off creates no MIG device and sets no time-slice interval:
# its prepare journals no intent (straight to PrepareCompleted), so neither the MIG
# failpoints nor the intent's nor a found intent's rollback are on its path.
NOT_ON_A_SHARES_PATH = frozenset(
    {"prepare-started-before-commit", "prepare-after-started", "prepare-rollback-after-cdi-removed"}
)
SHARE_FAILPOINTS = [
    name for name in FAILPOINTS if "-mig-" not in name and name not in NOT_ON_A_SHARES_PATH
]


def test_a_share_prepare_journals_no_intent(tmp_path: Path) -> None:
    """The failpoints a share skips are really not passed: armed, the prepare lives."""
    root = _root(tmp_path, "node")
    env = {**os.environ, ENV_VAR: ",".join(sorted(NOT_ON_A_SHARES_PATH))}
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS + "\nmain()\n", str(root), "prepare", SHARE_2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    entry = Checkpoint(root / "plugin").load()[UID_S2]
    assert entry.state is ClaimState.PREPARE_COMPLETED


@pytest.mark.parametrize("failpoint", SHARE_FAILPOINTS)
def test_kill_with_two_shares_of_one_gpu(failpoint: str, tmp_path: Path) -> None:
    """Share 1 of gpu-3 is prepared; the kill hits the prepare or unprepare of share 2
    of the same GPU. Share 1's spec and journal entry stay byte-exact through the
    crash, the recovery, share 2's retry and its unprepare."""
    scenario = SCENARIOS[failpoint]
    root = _root(tmp_path, "node")
    share_1, share_2 = _ref(SHARE_1), _ref(SHARE_2)
    assert _state(root).prepare([share_1])[UID_S1].ok
    first = _share_state(root, UID_S1)
    assert len(first[0]) == 1 and first[1] is not None
    assert f"{UID_S1}-gpu-3-s-1" in next(iter(first[0].values())).decode()
    if scenario == "unprepare":
        assert _state(root).prepare([share_2])[UID_S2].ok
        _crash(root, "unprepare", failpoint, (SHARE_2,))
    else:
        if scenario == "prepare-retry":
            _crash(root, "prepare", "prepare-after-cdi", (SHARE_2,))
        _crash(root, "prepare", failpoint, (SHARE_2,))
    assert _share_state(root, UID_S1) == first

    recovered = _copy(root, tmp_path / "recover")
    report = _state(recovered).recover()
    assert report.checkpoint_problem is None and report.orphan_specs == ()
    assert _temp_files(recovered) == []
    assert _share_state(recovered, UID_S1) == first
    second_specs, second_entry = _share_state(recovered, UID_S2)
    if RECOVERED_SHARES.get(failpoint, "empty") == "empty":
        assert (second_specs, second_entry) == ({}, None)
    else:
        assert second_entry is not None and len(second_specs) == 1
        assert f"{UID_S2}-gpu-3-s-2" in next(iter(second_specs.values())).decode()

    if scenario != "unprepare":  # the kubelet retries the prepare, later unprepares
        assert _state(root).prepare([share_2])[UID_S2].ok
        assert set(Checkpoint(root / "plugin").load()) == {UID_S1, UID_S2}
    assert _state(root).unprepare([share_2]) == {UID_S2: None}
    assert _share_state(root, UID_S1) == first
    assert set(Checkpoint(root / "plugin").load()) == {UID_S1}
    assert _temp_files(root) == []
    assert _state(root).unprepare([share_1]) == {UID_S1: None}
    _assert_empty(root)
