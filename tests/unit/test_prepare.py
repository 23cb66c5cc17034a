"""DeviceState: prepare/unprepare flow, verdict memory, idempotency, double-booking."""

from __future__ import annotations

import builtins
import copy
import io
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import driver.cdi.claim_specs as cdi_module
import driver.state.journal.checkpoint as checkpoint_module
from driver.cdi.claim_specs import ClaimSpec
from driver.devices.model import PublishedDevice
from driver.errors import DriverError, ErrorClass, parse_permanent_errors, transient
from driver.fileio import atomic_write
from driver.health.prepare_health import KubeDeviceHealth
from driver.health.store import HealthStore
from driver.observability import metrics
from driver.state.journal.checkpoint import (
    Checkpoint,
    ClaimEntry,
    ClaimState,
    HardwareRecord,
    PreparedDevice,
)
from driver.state.prepare import DeviceState
from driver.state.recovery.quarantine import quarantine_checkpoint
from driver.state.request import ClaimRef

DRIVER = "gpu.example.com"
NODE = "node-a"
KIND = "k8s.gpu.example.com/gpu"


# -- test doubles ------------------------------------------------------------------------


def _device(
    name: str,
    uuid: str,
    minor: int,
    *,
    max_partitions: int | None = None,
    profile: str | None = None,
    placement: tuple[int, int] | None = None,
    share_capacity: dict[str, int] | None = None,
) -> PublishedDevice:
    return PublishedDevice(
        name=name,
        document={"name": name},
        gpu_uuid=uuid,
        gpu_minor=minor,
        is_partition=profile is not None,
        max_partitions=max_partitions,
        profile=profile,
        placement=placement,
        share_capacity=share_capacity,
    )


DEVICES = {
    d.name: d
    for d in [
        # Multi-allocatable: the claims of `shared_claims` hold 1Gi shares of it.
        _device("gpu-0", "GPU-aaaa", 0, max_partitions=7, share_capacity={"memory": 64 << 30}),
        _device("gpu-1", "GPU-bbbb", 1, max_partitions=7),
        _device("gpu-0-mig-1g10gb-3", "GPU-aaaa", 0, profile="1g.10gb", placement=(3, 1)),
    ]
}


class FakeClaims:
    def __init__(self) -> None:
        self.docs: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls = 0
        self.error: DriverError | None = None

    def add(self, claim: dict[str, Any]) -> ClaimRef:
        meta = claim["metadata"]
        self.docs[(meta["namespace"], meta["name"])] = claim
        return ClaimRef(meta["namespace"], meta["name"], meta["uid"])

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        self.calls += 1
        if self.error is not None:
            raise self.error
        try:
            return copy.deepcopy(self.docs[(namespace, name)])
        except KeyError:
            raise transient(f"resourceclaims {namespace}/{name} not found") from None


@dataclass
class FakeHealth:
    failures: dict[str, str] = field(default_factory=dict)
    taint_error: Exception | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)

    def failure(self, device_name: str) -> str | None:
        self.calls.append(("failure", device_name))
        return self.failures.get(device_name)

    def ensure_tainted(self, device_name: str) -> None:
        self.calls.append(("taint", device_name))
        if self.taint_error is not None:
            raise self.taint_error


@dataclass
class FakeReporter:
    reports: list[tuple[str, DriverError]] = field(default_factory=list)
    health: FakeHealth | None = None
    taints_seen: list[int] = field(default_factory=list)

    def permanent_failure(self, claim: dict[str, Any], error: DriverError) -> None:
        self.reports.append((claim["metadata"]["uid"], error))
        if self.health is not None:
            self.taints_seen.append(sum(1 for c in self.health.calls if c[0] == "taint"))


def make_claim(
    uid: str,
    results: list[dict[str, Any]],
    *,
    configs: list[dict[str, Any]] | None = None,
    node: str | None = NODE,
    name: str | None = None,
    allocated: bool = True,
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    if allocated:
        allocation: dict[str, Any] = {"devices": {"results": results, "config": configs or []}}
        if node is not None:
            allocation["nodeSelector"] = {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            }
        status["allocation"] = allocation
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name or f"claim-{uid}", "uid": uid},
        "status": status,
    }


def result(device: str, request: str = "gpu", **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": NODE, "device": device, **extra}


def gpu_config(
    sharing: dict[str, Any], requests: list[str] | None = None, source: str = "FromClaim"
) -> dict[str, Any]:
    return {
        "source": source,
        "requests": requests or [],
        "opaque": {
            "driver": DRIVER,
            "parameters": {
                "apiVersion": "gpu.resource.example.com/v1alpha1",
                "kind": "GpuConfig",
                "sharing": sharing,
            },
        },
    }


@dataclass
class Env:
    state: DeviceState
    claims: FakeClaims
    health: FakeHealth
    reporter: FakeReporter
    cdi_root: Path
    data_dir: Path
    now: list[float]

    def spec(self, uid: str) -> dict[str, Any]:
        doc = self.state.cdi.read_claim_spec(uid)
        assert doc is not None, f"no CDI spec for {uid}"
        return doc

    def env_of(self, uid: str, index: int = 0) -> list[str]:
        return list(self.spec(uid)["devices"][index]["containerEdits"]["env"])

    def journal(self) -> dict[str, ClaimEntry]:
        return Checkpoint(self.data_dir).load()

    def spec_content(self, uid: str) -> ClaimSpec:
        """The claim's spec file as the journal stores it."""
        doc = self.spec(uid)
        nodes = [n["path"] for n in doc["containerEdits"].get("deviceNodes", [])]
        return ClaimSpec.from_json({"devices": doc["devices"], "deviceNodes": nodes})

    def prepare_one(self, ref: ClaimRef) -> Any:
        return self.state.prepare([ref])[ref.uid]

    def new_state(self, **kwargs: Any) -> DeviceState:
        args: dict[str, Any] = {
            "driver_name": DRIVER,
            "node_name": NODE,
            "devices": DEVICES,
            "cdi_root": self.cdi_root,
            "data_dir": self.data_dir,
            "claims": self.claims,
            "health": self.health,
            "reporter": self.reporter,
            "lock_timeout": 2.0,
            "clock": lambda: self.now[0],
            "proc_devices": Path(__file__).parent / "data" / "proc-devices",
        }
        args.update(kwargs)
        return DeviceState(**args)


def make_env(tmp_path: Path, **state_kwargs: Any) -> Env:
    """An Env under `tmp_path` whose state is `new_state(**state_kwargs)`."""
    health = FakeHealth()
    e = Env(
        state=None,  # type: ignore[arg-type]
        claims=FakeClaims(),
        health=health,
        reporter=FakeReporter(health=health),
        cdi_root=tmp_path / "cdi",
        data_dir=tmp_path / "plugin",
        now=[1000.0],
    )
    e.state = e.new_state(**state_kwargs)
    return e


@pytest.fixture
def env(tmp_path: Path) -> Env:
    return make_env(tmp_path)


# -- happy paths ---------------------------------------------------------------------------


def test_gpu_claim_default_config(env: Env) -> None:
    ref = env.claims.add(make_claim("uid-1", [result("gpu-0")]))
    res = env.prepare_one(ref)
    assert res.ok and res.error is None
    assert res.devices == (
        PreparedDevice(
            pool_name=NODE,
            device_name="gpu-0",
            request_names=("gpu",),
            cdi_device_ids=(f"{KIND}=uid-1-gpu-0", f"{KIND}=common"),
            share_id=None,
            admin_access=False,
            hardware=HardwareRecord("GPU-aaaa", multi_allocatable=True),
        ),
    )
    spec = env.spec("uid-1")
    assert spec["kind"] == KIND and spec["containerEdits"] == {}
    assert spec["devices"][0]["name"] == "uid-1-gpu-0"
    assert env.env_of("uid-1") == [
        "GPU_DEVICE_GPU_0_RESOURCE_CLAIM=uid-1",
        "DRA_ADMIN_ACCESS=false",
        "GPU_DEVICE_0=gpu-0",
        "GPU_DEVICE_0_SHARING_STRATEGY=TimeSlicing",
        "GPU_DEVICE_0_TIMESLICE_INTERVAL=Default",
        "NVIDIA_VISIBLE_DEVICES=void",
    ]
    assert "deviceNodes" not in spec["devices"][0]["containerEdits"]  # mock: env only
    journal = env.journal()
    assert journal == {
        "uid-1": ClaimEntry(
            ClaimState.PREPARE_COMPLETED,
            "default",
            "claim-uid-1",
            res.devices,
            env.spec_content("uid-1"),
        )
    }
    assert env.state.stats.prepared == 1 and env.state.stats.claim_reads == 1


def test_real_gpu_devices_carry_only_their_own_complete_nodes(env: Env) -> None:
    """Two requests of one claim: each CDI device (what a container referencing that
    request gets) has its own GPU's node, complete, and names no other GPU; the
    control nodes and the driver are in the common spec, not repeated per claim."""
    env.state = env.new_state(real_devices=True)
    ref = env.claims.add(
        make_claim("uid-1", [result("gpu-0", request="a"), result("gpu-1", request="b")])
    )
    assert env.prepare_one(ref).ok
    spec = env.spec("uid-1")
    assert spec["containerEdits"] == {}
    for index, minor in ((0, 0), (1, 1)):
        edits = spec["devices"][index]["containerEdits"]
        assert edits["deviceNodes"] == [
            {
                "path": f"/dev/nvidia{minor}",
                "type": "c",
                "major": 195,
                "minor": minor,
                "fileMode": 0o666,
            }
        ]
        assert edits["env"][-1] == "NVIDIA_VISIBLE_DEVICES=void"
        assert not any("GPU-aaaa" in e or "GPU-bbbb" in e for e in edits["env"])


def test_real_gpu_prepare_without_the_nvidia_module_is_transient(env: Env, tmp_path: Path) -> None:
    no_nvidia = tmp_path / "proc-devices"
    no_nvidia.write_text("Character devices:\n  1 mem\n\nBlock devices:\n  7 loop\n")
    env.state = env.new_state(real_devices=True, proc_devices=no_nvidia)
    ref = env.claims.add(make_claim("uid-1", [result("gpu-0")]))
    res = env.prepare_one(ref)
    assert res.error is not None and res.error.error_class.value == "transient", res.error
    assert "no 'nvidia' character device in /proc/devices" in str(res.error)
    assert env.journal() == {} and not env.state.cdi.claim_spec_exists("uid-1")


def test_config_env_vars_and_subrequests(env: Env) -> None:
    claim = make_claim(
        "uid-c",
        [result("gpu-0", request="a/fast"), result("gpu-1", request="b")],
        configs=[
            gpu_config(
                {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}, ["a"]
            ),
            gpu_config(
                {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 4}},
                ["b"],
            ),
        ],
    )
    res = env.prepare_one(env.claims.add(claim))
    assert res.ok, res.error
    assert [d.request_names for d in res.devices] == [("a",), ("b",)]
    assert "GPU_DEVICE_0_TIMESLICE_INTERVAL=Long" in env.env_of("uid-c", 0)
    env1 = env.env_of("uid-c", 1)
    assert "GPU_DEVICE_1_SHARING_STRATEGY=SpacePartitioning" in env1
    assert "GPU_DEVICE_1_PARTITION_COUNT=4" in env1
    assert not any("TIMESLICE" in v for v in env1)


def test_shares_admin_access_and_consumed_capacity(env: Env) -> None:
    a = env.claims.add(
        make_claim("uid-a", [result("gpu-0", shareID="s-1", consumedCapacity={"memory": "8Gi"})])
    )
    b = env.claims.add(
        make_claim("uid-b", [result("gpu-0", shareID="s-2", consumedCapacity={"memory": "8Gi"})])
    )
    admin = env.claims.add(make_claim("uid-x", [result("gpu-0", adminAccess=True)]))
    ra, rb, rx = (env.prepare_one(r) for r in (a, b, admin))
    assert ra.ok and rb.ok and rx.ok, (ra.error, rb.error, rx.error)
    assert ra.devices[0].share_id == "s-1"
    assert ra.devices[0].cdi_device_ids[0] == f"{KIND}=uid-a-gpu-0-s-1"
    assert env.spec("uid-a")["devices"][0]["name"] == "uid-a-gpu-0-s-1"
    assert "GPU_DEVICE_0_MEMORY=8Gi" in env.env_of("uid-a")
    assert rx.devices[0].admin_access is True
    assert "DRA_ADMIN_ACCESS=true" in env.env_of("uid-x")
    assert set(env.journal()) == {"uid-a", "uid-b", "uid-x"}


def test_batch_results_keyed_by_uid(env: Env) -> None:
    good = env.claims.add(make_claim("uid-g", [result("gpu-0")]))
    missing = ClaimRef("default", "nope", "uid-n")
    out = env.state.prepare([good, missing])
    assert set(out) == {"uid-g", "uid-n"}
    assert out["uid-g"].ok
    err = out["uid-n"].error
    assert err is not None and not err.permanent and "not found" in str(err)


# -- batches: a constant number of journal writes per request ------------------------------


class BatchSpy:
    """Every atomic write (journal or CDI spec) and every fsync, file or directory."""

    def __init__(self, env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
        self.journal_path = env.data_dir / "checkpoint.json"
        self.targets: list[Path] = []
        self.file_fsyncs = 0
        self.dir_fsyncs = 0
        self.fail_for: set[Path] = set()
        self.fail_journal_write: int | None = None  # which store attempt fails (1-based)
        self.journal_attempts = 0

        def spying(target: Path, data: bytes, **kwargs: Any) -> None:
            if target in self.fail_for:
                raise OSError(28, "No space left on device")
            if target == self.journal_path:
                self.journal_attempts += 1
                if self.journal_attempts == self.fail_journal_write:
                    raise OSError(5, "Input/output error")
            self.targets.append(target)
            atomic_write(target, data, **kwargs)

        monkeypatch.setattr(cdi_module, "atomic_write", spying)
        monkeypatch.setattr(checkpoint_module, "atomic_write", spying)
        real_append = checkpoint_module.append

        def spying_append(fd: int, record: bytes, **kwargs: Any) -> None:
            # A journal store on the log (docs/state.md, "The log").
            self.journal_attempts += 1
            if self.journal_attempts == self.fail_journal_write:
                raise OSError(5, "Input/output error")
            self.targets.append(self.journal_path)
            real_append(fd, record, **kwargs)

        monkeypatch.setattr(checkpoint_module, "append", spying_append)
        real_fsync, real_fdatasync = os.fsync, os.fdatasync

        def counting(fd: int) -> None:
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                self.dir_fsyncs += 1
            else:
                self.file_fsyncs += 1
            real_fsync(fd)

        def counting_fdatasync(fd: int) -> None:
            self.file_fsyncs += 1
            real_fdatasync(fd)

        monkeypatch.setattr(os, "fsync", counting)
        monkeypatch.setattr(os, "fdatasync", counting_fdatasync)

    @property
    def journal_writes(self) -> list[Path]:
        return [t for t in self.targets if t == self.journal_path]

    @property
    def spec_writes(self) -> list[Path]:
        return [t for t in self.targets if t != self.journal_path]


def temp_files(env: Env) -> list[Path]:
    return [
        p
        for d in (env.cdi_root, env.data_dir)
        if d.exists()
        for p in d.iterdir()
        if ".tmp-" in p.name
    ]


def shared_claims(env: Env, n: int) -> list[ClaimRef]:
    """`n` claims that each hold a share of gpu-0, so none conflicts with another."""
    return [
        env.claims.add(
            make_claim(
                f"uid-{i:02d}",
                [result("gpu-0", shareID=f"s-{i}", consumedCapacity={"memory": "1Gi"})],
            )
        )
        for i in range(n)
    ]


def test_batch_of_64_claims_costs_two_journal_writes(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = shared_claims(env, 64)
    env.state.recover()  # the common spec, and the directories exist
    spy = BatchSpy(env, monkeypatch)
    writes_before = metrics.STATE_FILE_WRITES._value.get()
    out = env.state.prepare(refs)
    assert all(r.ok for r in out.values()) and len(out) == 64
    # Shares create no MIG device and set no interval: no intent is journaled, the
    # batch goes straight to one PrepareCompleted store.
    assert len(spy.journal_writes) == 1
    assert sorted(spy.spec_writes) == sorted(env.state.cdi.claim_spec_path(r.uid) for r in refs)
    assert metrics.STATE_FILE_WRITES._value.get() - writes_before == 65
    # Only the journal is synced: the entries carry the specs, and recover() rewrites
    # a spec a power loss took or garbled. The first store after start writes the
    # snapshot (file and directory); later ones append to the log.
    assert (spy.file_fsyncs, spy.dir_fsyncs) == (1, 1)
    journal = env.journal()
    assert set(journal) == {r.uid for r in refs}
    assert {e.state for e in journal.values()} == {ClaimState.PREPARE_COMPLETED}
    assert env.state.stats.prepared == 64

    spy.targets.clear()
    spy.file_fsyncs = spy.dir_fsyncs = 0
    assert env.state.prepare(refs) == out  # idempotent: nothing written at all
    assert (spy.targets, spy.file_fsyncs, spy.dir_fsyncs) == ([], 0, 0)

    assert env.state.unprepare(refs) == {r.uid: None for r in refs}
    assert len(spy.journal_writes) == 1 and spy.spec_writes == []
    assert (spy.file_fsyncs, spy.dir_fsyncs) == (1, 0)  # the log's fdatasync only
    assert env.journal() == {} and env.state.cdi.list_claim_specs() == {}
    assert env.state.stats.unprepared == 64


def test_one_failing_claim_in_a_batch_rolls_back_alone(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = shared_claims(env, 10)
    spy = BatchSpy(env, monkeypatch)
    bad = refs[3].uid
    spy.fail_for.add(env.state.cdi.claim_spec_path(bad))
    out = env.state.prepare(refs)
    err = out[bad].error
    assert err is not None and not err.permanent and "No space left" in str(err)
    good = [r.uid for r in refs if r.uid != bad]
    assert all(out[uid].ok for uid in good)
    assert len(spy.journal_writes) == 1
    journal = env.journal()
    assert set(journal) == set(good)
    assert {e.state for e in journal.values()} == {ClaimState.PREPARE_COMPLETED}
    assert set(env.state.cdi.list_claim_specs()) == set(good)
    assert temp_files(env) == []
    assert env.state.stats.prepared == 9 and env.state.remembered_verdict(bad) is None

    spy.fail_for.clear()  # transient: the kubelet's retry of the same request succeeds
    spy.targets.clear()
    again = env.state.prepare(refs)
    assert all(r.ok for r in again.values())
    assert {uid: again[uid] for uid in good} == {uid: out[uid] for uid in good}
    assert len(spy.journal_writes) == 1 and len(spy.spec_writes) == 1
    assert set(env.journal()) == {r.uid for r in refs}


def test_checks_fail_claims_alone_and_before_anything_is_written(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = shared_claims(env, 3)
    invalid = env.claims.add(
        make_claim("uid-bad", [result("gpu-1")], configs=[gpu_config({"strategy": "Bogus"})])
    )
    spy = BatchSpy(env, monkeypatch)
    out = env.state.prepare([ok[0], invalid, ok[1], ClaimRef("default", "gone", "uid-x"), ok[2]])
    assert [out[r.uid].ok for r in ok] == [True, True, True]
    bad_err = out["uid-bad"].error
    assert bad_err is not None and bad_err.permanent
    assert out["uid-x"].error is not None
    assert len(spy.journal_writes) == 1 and len(spy.spec_writes) == 3
    assert set(env.journal()) == {r.uid for r in ok}


def test_double_booking_is_refused_between_claims_of_one_request(env: Env) -> None:
    a = env.claims.add(make_claim("uid-a", [result("gpu-0")]))
    b = env.claims.add(make_claim("uid-b", [result("gpu-0")]))
    mig = env.claims.add(make_claim("uid-m", [result("gpu-0-mig-1g10gb-3")]))
    c = env.claims.add(make_claim("uid-c", [result("gpu-1")]))
    out = env.state.prepare([a, b, mig, c])
    assert out["uid-a"].ok and out["uid-c"].ok
    for uid in ("uid-b", "uid-m"):
        err = out[uid].error
        assert err is not None and not err.permanent
        assert "default/claim-uid-a" in str(err) and "uid-a" in str(err)
    assert set(env.journal()) == {"uid-a", "uid-c"}
    assert set(env.state.cdi.list_claim_specs()) == {"uid-a", "uid-c"}


def test_duplicate_uids_in_one_request_are_prepared_once(env: Env) -> None:
    (ref,) = shared_claims(env, 1)
    out = env.state.prepare([ref, ref])
    assert list(out) == [ref.uid] and out[ref.uid].ok
    assert env.state.stats.prepared == 1 and env.state.stats.claim_reads == 1


def test_a_failed_journal_store_fails_and_rolls_back_the_whole_batch(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shares journal no intent: their one store is the PrepareCompleted one (a failed
    intent store of MIG claims: tests/unit/test_mig_prepare.py)."""
    refs = shared_claims(env, 5)
    spy = BatchSpy(env, monkeypatch)
    spy.fail_journal_write = 1
    out = env.state.prepare(refs)
    for r in refs:
        err = out[r.uid].error
        assert err is not None and not err.permanent and "checkpoint" in str(err)
    assert env.journal() == {} and env.state.cdi.list_claim_specs() == {}
    assert temp_files(env) == []
    spy.fail_journal_write = None
    assert all(r.ok for r in env.state.prepare(refs).values())


def test_a_half_done_claim_in_a_batch_is_redone_with_the_others(env: Env) -> None:
    refs = shared_claims(env, 3)
    stale = PreparedDevice(NODE, "gpu-1", ("gpu",), ("stale",))
    Checkpoint(env.data_dir).store(
        {refs[1].uid: ClaimEntry(ClaimState.PREPARE_STARTED, "default", "x", (stale,))}
    )
    env.state.cdi.write_claim_spec(refs[1].uid, ClaimSpec(()))
    out = env.state.prepare(refs)
    assert all(r.ok for r in out.values())
    assert env.state.stats.rollbacks == 1
    journal = env.journal()
    assert {uid: e.devices for uid, e in journal.items()} == {
        r.uid: out[r.uid].devices for r in refs
    }
    assert [d["name"] for d in env.spec(refs[1].uid)["devices"]] == [f"{refs[1].uid}-gpu-0-s-1"]


# -- idempotency -------------------------------------------------------------------------


class WriteSpy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.replaces = 0
        real = os.replace

        def counting(src: Any, dst: Any) -> None:
            self.replaces += 1
            real(src, dst)

        monkeypatch.setattr(os, "replace", counting)


def test_prepare_twice_answers_the_same_without_writing(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = env.claims.add(make_claim("uid-1", [result("gpu-0")]))
    first = env.prepare_one(ref)
    spy = WriteSpy(monkeypatch)
    second = env.prepare_one(ref)
    assert second == first
    assert spy.replaces == 0
    assert env.state.stats.idempotent_hits == 1 and env.state.stats.prepared == 1


def test_completed_claim_whose_cdi_spec_vanished_is_rewritten(env: Env) -> None:
    ref = env.claims.add(make_claim("uid-1", [result("gpu-0")]))
    first = env.prepare_one(ref)
    before = env.state.cdi.claim_spec_path("uid-1").read_bytes()
    env.state.cdi.remove_claim_spec("uid-1")  # e.g. /var/run/cdi is tmpfs, node rebooted
    again = env.prepare_one(ref)
    assert again == first
    assert env.state.cdi.claim_spec_path("uid-1").read_bytes() == before
    assert env.journal()["uid-1"].state is ClaimState.PREPARE_COMPLETED


def test_half_done_prepare_is_rolled_back_and_completed(env: Env) -> None:
    ref = env.claims.add(make_claim("uid-1", [result("gpu-0")]))
    stale = PreparedDevice(NODE, "gpu-1", ("gpu",), ("stale",))
    Checkpoint(env.data_dir).store(
        {"uid-1": ClaimEntry(ClaimState.PREPARE_STARTED, "default", "claim-uid-1", (stale,))}
    )
    env.state.cdi.write_claim_spec("uid-1", ClaimSpec(()))
    res = env.prepare_one(ref)
    assert res.ok and res.devices[0].device_name == "gpu-0"
    assert env.journal() == {
        "uid-1": ClaimEntry(
            ClaimState.PREPARE_COMPLETED,
            "default",
            "claim-uid-1",
            res.devices,
            env.spec_content("uid-1"),
        )
    }
    assert [d["name"] for d in env.spec("uid-1")["devices"]] == ["uid-1-gpu-0"]
    assert list(env.state.cdi.list_claim_specs()) == ["uid-1"]
    assert env.state.stats.rollbacks == 1


def test_failure_after_writing_started_rolls_back(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = env.claims.add(make_claim("uid-1", [result("gpu-0")]))

    def broken(*args: Any, **kwargs: Any) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(env.state.cdi, "write_claim_spec", broken)
    res = env.prepare_one(ref)
    assert res.error is not None and not res.error.permanent
    assert "No space left" in str(res.error)
    assert env.journal() == {}
    assert env.state.cdi.list_claim_specs() == {}
    monkeypatch.undo()
    assert env.prepare_one(ref).ok  # transient: not remembered


# -- permanent verdicts ------------------------------------------------------------------


def test_invalid_config_is_permanent_remembered_and_cheap(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim("uid-bad", [result("gpu-0")], configs=[gpu_config({"strategy": "Bogus"})])
    ref = env.claims.add(claim)
    res = env.prepare_one(ref)
    err = res.error
    assert err is not None and err.permanent and err.error_class is ErrorClass.INVALID_CONFIG
    assert str(err).startswith("permanent (invalid-config): ")
    assert "sharing.strategy" in str(err)
    assert [uid for uid, _ in env.reporter.reports] == ["uid-bad"]
    assert not any(c[0] == "taint" for c in env.health.calls)  # never taints
    assert env.journal() == {} and env.state.cdi.list_claim_specs() == {}

    reads, health_calls = env.claims.calls, len(env.health.calls)
    spy = WriteSpy(monkeypatch)
    forbidden_calls: list[Any] = []

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        forbidden_calls.append(args)
        raise AssertionError("disk access")

    for module, name in [
        (os, "open"),
        (os, "listdir"),
        (os, "stat"),
        (os, "unlink"),
        (builtins, "open"),
        (io, "open"),
    ]:
        monkeypatch.setattr(module, name, forbidden)
    for _ in range(100):
        again = env.prepare_one(ref)
        assert again.error is err
    monkeypatch.undo()
    assert forbidden_calls == [] and spy.replaces == 0
    assert env.claims.calls == reads  # no API reads
    assert len(env.health.calls) == health_calls  # no health / NVML
    assert env.state.stats.verdict_hits == 100
    assert env.state.stats.permanent_failures == 1
    assert len(env.reporter.reports) == 1  # reported once per verdict


def test_impossible_partition_count_is_invalid_config_and_never_taints(env: Env) -> None:
    too_many = make_claim(
        "uid-p",
        [result("gpu-0")],
        configs=[
            gpu_config(
                {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 8}}
            )
        ],
    )
    on_partition = make_claim(
        "uid-q",
        [result("gpu-0-mig-1g10gb-3")],
        configs=[
            gpu_config(
                {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 1}}
            )
        ],
    )
    for claim in (too_many, on_partition):
        err = env.prepare_one(env.claims.add(claim)).error
        assert err is not None and err.error_class is ErrorClass.INVALID_CONFIG
        assert "impossible partition count" in str(err)
    assert not any(c[0] == "taint" for c in env.health.calls)
    assert env.journal() == {}


def test_failed_device_is_tainted_before_the_permanent_error(env: Env) -> None:
    env.health.failures["gpu-1"] = "Xid 79 (GPU has fallen off the bus)"
    ref = env.claims.add(make_claim("uid-f", [result("gpu-0"), result("gpu-1")]))
    err = env.prepare_one(ref).error
    assert err is not None and err.error_class is ErrorClass.DEVICE_FAILED
    assert str(err).startswith("permanent (device-failed): ")
    assert "gpu-1: Xid 79" in str(err)
    assert ("taint", "gpu-1") in env.health.calls
    assert ("taint", "gpu-0") not in env.health.calls
    assert env.reporter.taints_seen == [1]  # the taint happened before reporting/returning
    assert env.journal() == {} and env.state.cdi.list_claim_specs() == {}
    reads = env.claims.calls
    assert env.prepare_one(ref).error is err
    assert env.claims.calls == reads


def test_taint_failure_is_transient_and_not_remembered(env: Env) -> None:
    env.health.failures["gpu-0"] = "GPU is lost"
    env.health.taint_error = RuntimeError("apiserver unavailable")
    ref = env.claims.add(make_claim("uid-f", [result("gpu-0")]))
    err = env.prepare_one(ref).error
    assert err is not None and not err.permanent and "apiserver unavailable" in str(err)
    assert env.reporter.reports == []
    env.health.taint_error = None
    err2 = env.prepare_one(ref).error
    assert err2 is not None and err2.error_class is ErrorClass.DEVICE_FAILED
    assert env.claims.calls == 2


def test_permanent_errors_flag_downgrades_a_class(env: Env) -> None:
    env.state = env.new_state(permanent_errors=parse_permanent_errors("device-failed"))
    ref = env.claims.add(
        make_claim("uid-bad", [result("gpu-0")], configs=[gpu_config({"strategy": "Bogus"})])
    )
    err = env.prepare_one(ref).error
    assert err is not None and not err.permanent
    assert "invalid-config" in str(err) and "--permanent-errors" in str(err)
    assert not str(err).startswith("permanent")
    assert env.reporter.reports == []
    env.prepare_one(ref)
    assert env.claims.calls == 2  # not remembered


def test_parse_permanent_errors() -> None:
    assert parse_permanent_errors("invalid-config,device-failed") == {
        ErrorClass.INVALID_CONFIG,
        ErrorClass.DEVICE_FAILED,
    }
    assert parse_permanent_errors("") == frozenset()
    for bad in ("transient", "nope"):
        with pytest.raises(ValueError):
            parse_permanent_errors(bad)


def test_verdict_expires_after_ttl(env: Env) -> None:
    env.state = env.new_state(verdict_ttl=60.0)
    ref = env.claims.add(
        make_claim("uid-bad", [result("gpu-0")], configs=[gpu_config({"strategy": "Bogus"})])
    )
    env.prepare_one(ref)
    env.now[0] += 59
    env.prepare_one(ref)
    assert env.claims.calls == 1
    env.now[0] += 2
    assert env.prepare_one(ref).error is not None
    assert env.claims.calls == 2


def test_unprepare_clears_the_verdict(env: Env) -> None:
    claim = make_claim("uid-bad", [result("gpu-0")], configs=[gpu_config({"strategy": "Bogus"})])
    ref = env.claims.add(claim)
    env.prepare_one(ref)
    assert env.state.unprepare([ref]) == {"uid-bad": None}
    assert env.state.remembered_verdict("uid-bad") is None
    env.prepare_one(ref)
    assert env.claims.calls == 2


# -- claim checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        (make_claim("other-uid", [result("gpu-0")], name="claim-x"), "does not match"),
        (make_claim("uid-x", [], allocated=False, name="claim-x"), "not yet allocated"),
        (make_claim("uid-x", [result("gpu-0")], node="node-b", name="claim-x"), "different node"),
        (
            make_claim(
                "uid-x", [{**result("gpu-0"), "driver": "other.example.com"}], name="claim-x"
            ),
            "no allocation results",
        ),
        (make_claim("uid-x", [result("gpu-9")], name="claim-x"), "not allocatable: gpu-9"),
    ],
)
def test_claim_checks_are_transient(env: Env, claim: dict[str, Any], message: str) -> None:
    env.claims.add(claim)
    err = env.prepare_one(ClaimRef("default", "claim-x", "uid-x")).error
    assert err is not None and not err.permanent and message in str(err)
    assert env.state.remembered_verdict("uid-x") is None
    assert env.reporter.reports == []


def test_claim_without_node_selector_is_accepted(env: Env) -> None:
    ref = env.claims.add(make_claim("uid-1", [result("gpu-0")], node=None))
    assert env.prepare_one(ref).ok


def test_api_error_is_transient(env: Env) -> None:
    env.claims.error = transient("connection refused")
    err = env.prepare_one(ClaimRef("default", "c", "u")).error
    assert err is not None and not err.permanent and "connection refused" in str(err)


# -- double booking ----------------------------------------------------------------------


def test_device_of_another_claim_is_never_double_booked(env: Env) -> None:
    a = env.claims.add(make_claim("uid-a", [result("gpu-0")]))
    b = env.claims.add(make_claim("uid-b", [result("gpu-0")]))
    mig = env.claims.add(make_claim("uid-m", [result("gpu-0-mig-1g10gb-3")]))
    assert env.prepare_one(a).ok
    for ref in (b, mig):
        err = env.prepare_one(ref).error
        assert err is not None and not err.permanent
        assert "default/claim-uid-a" in str(err) and "uid-a" in str(err)
    assert set(env.journal()) == {"uid-a"}
    assert list(env.state.cdi.list_claim_specs()) == ["uid-a"]
    assert env.state.unprepare([a]) == {"uid-a": None}
    assert env.prepare_one(b).ok


def test_half_prepared_claim_also_holds_its_device(env: Env) -> None:
    held = PreparedDevice(NODE, "gpu-0", ("gpu",), ("x",))
    Checkpoint(env.data_dir).store(
        {"uid-a": ClaimEntry(ClaimState.PREPARE_STARTED, "default", "claim-uid-a", (held,))}
    )
    b = env.claims.add(make_claim("uid-b", [result("gpu-0")]))
    err = env.prepare_one(b).error
    assert err is not None and "PrepareStarted" in str(err)


# -- unprepare ---------------------------------------------------------------------------


def test_unprepare_removes_spec_and_entry_and_is_idempotent(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = env.claims.add(make_claim("uid-a", [result("gpu-0")]))
    b = env.claims.add(make_claim("uid-b", [result("gpu-1")]))
    env.state.prepare([a, b])
    assert env.state.unprepare([a]) == {"uid-a": None}
    assert set(env.journal()) == {"uid-b"}
    assert list(env.state.cdi.list_claim_specs()) == ["uid-b"]
    spy = WriteSpy(monkeypatch)
    assert env.state.unprepare([a, ClaimRef("x", "y", "never-seen")]) == {
        "uid-a": None,
        "never-seen": None,
    }
    assert spy.replaces == 0  # nothing to do, nothing written


def test_unprepare_of_a_failed_device_is_local_only(env: Env) -> None:
    ref = env.claims.add(make_claim("uid-a", [result("gpu-0")]))
    assert env.prepare_one(ref).ok
    env.health.failures["gpu-0"] = "GPU is lost"
    env.claims.error = transient("apiserver down")
    calls = len(env.health.calls)
    assert env.state.unprepare([ref]) == {"uid-a": None}
    assert len(env.health.calls) == calls and env.reporter.reports == []
    assert env.journal() == {} and env.state.cdi.list_claim_specs() == {}


# -- corrupt checkpoint ------------------------------------------------------------------


def test_corrupt_checkpoint_is_detected_reported_and_kept(env: Env) -> None:
    a = env.claims.add(make_claim("uid-a", [result("gpu-0")]))
    b = env.claims.add(make_claim("uid-b", [result("gpu-1")]))
    assert env.prepare_one(a).ok
    path = env.data_dir / "checkpoint.json"
    good = path.read_bytes()
    doc = json.loads(good)
    doc["entries"]["uid-a"]["devices"][0]["device"] = "gpu-7"  # bit rot
    path.write_text(json.dumps(doc))
    corrupt = path.read_bytes()

    err = env.prepare_one(b).error
    assert err is not None and not err.permanent
    assert str(path) in str(err) and "checksum mismatch" in str(err)
    assert env.state.checkpoint_problem is not None and str(path) in env.state.checkpoint_problem
    assert env.state.stats.checkpoint_corrupt == 1
    assert path.read_bytes() == corrupt  # never discarded or rewritten
    assert env.state.remembered_verdict("uid-b") is None

    # Unprepare still succeeds (teardown must not wedge) and removes the CDI spec.
    assert env.state.unprepare([a]) == {"uid-a": None}
    assert env.state.cdi.list_claim_specs() == {}
    assert path.read_bytes() == corrupt

    # The operator restores a good copy: the owed removal of uid-a is applied.
    path.write_bytes(good)
    assert env.prepare_one(b).ok
    assert set(env.journal()) == {"uid-b"}
    assert env.state.checkpoint_problem is None


def test_quarantined_checkpoint_lets_prepare_resume(env: Env) -> None:
    env.data_dir.mkdir(parents=True)
    (env.data_dir / "checkpoint.json").write_text("not json")
    ref = env.claims.add(make_claim("uid-a", [result("gpu-0")]))
    assert env.prepare_one(ref).error is not None
    moved = quarantine_checkpoint(env.data_dir)
    assert moved is not None and moved.read_text() == "not json"
    assert env.prepare_one(ref).ok


# -- startup recovery --------------------------------------------------------------------


def test_recover_rolls_back_started_entries_and_removes_orphans(env: Env) -> None:
    a = env.claims.add(make_claim("uid-a", [result("gpu-0")]))
    assert env.prepare_one(a).ok
    cp = Checkpoint(env.data_dir)
    journal = cp.load()
    held = PreparedDevice(NODE, "gpu-1", ("gpu",), ("x",))
    journal["uid-s"] = ClaimEntry(ClaimState.PREPARE_STARTED, "default", "claim-s", (held,))
    cp.store(journal)
    env.state.cdi.write_claim_spec("uid-s", ClaimSpec(()))
    env.state.cdi.write_claim_spec("uid-orphan", ClaimSpec(()))
    temp = env.state.cdi.root / ".k8s.gpu.example.com-gpu_uid-z.json.tmp-00ff"
    temp.write_text("{")

    report = env.new_state().recover()
    assert report.checkpoint_problem is None
    assert report.rolled_back == ("uid-s",)
    # A spec no entry owns (a prepare whose entry never became durable, an
    # unprepare a power loss undid) is removed.
    assert report.orphan_specs == () and report.removed_specs == ("uid-orphan",)
    assert report.missing_specs == ()
    assert temp in report.swept_temp_files and not temp.exists()
    assert set(cp.load()) == {"uid-a"}
    assert set(env.state.cdi.list_claim_specs()) == {"uid-a"}
    assert env.state.cdi.common_spec_path.exists()


def test_recover_reports_a_corrupt_checkpoint(env: Env) -> None:
    env.data_dir.mkdir(parents=True)
    (env.data_dir / "checkpoint.json").write_text("[]")
    report = env.state.recover()
    assert (
        report.checkpoint_problem is not None and "not a JSON object" in report.checkpoint_problem
    )
    assert env.state.checkpoint_problem == report.checkpoint_problem


def test_verdict_memory_is_bounded(env: Env) -> None:
    env.state = env.new_state(verdict_limit=2)
    refs = [
        env.claims.add(
            make_claim(f"uid-{i}", [result("gpu-0")], configs=[gpu_config({"strategy": "X"})])
        )
        for i in range(3)
    ]
    for ref in refs:
        env.prepare_one(ref)
    assert env.state.remembered_verdict("uid-0") is None  # evicted, oldest first
    assert env.state.remembered_verdict("uid-1") is not None
    assert env.state.remembered_verdict("uid-2") is not None


def _wipe_cdi_root(env: Env) -> None:
    """What a reboot does to /var/run/cdi (a tmpfs): every spec gone, journal kept."""
    for path in env.cdi_root.iterdir():
        path.unlink()


def test_start_recreates_every_completed_claims_spec_byte_exact(env: Env) -> None:
    env.state = env.new_state(real_devices=True)
    refs = [env.claims.add(make_claim(f"uid-{i}", [result(f"gpu-{i}")])) for i in range(2)]
    assert all(r.ok for r in env.state.prepare(refs).values())
    before = {uid: p.read_bytes() for uid, p in env.state.cdi.list_claim_specs().items()}
    _wipe_cdi_root(env)

    restarted = env.new_state(real_devices=True)  # a new process: no memory of the specs
    env.claims.calls = 0
    report = restarted.recover()

    assert sorted(report.recreated_specs) == ["uid-0", "uid-1"]
    assert report.missing_specs == ()
    after = {uid: p.read_bytes() for uid, p in restarted.cdi.list_claim_specs().items()}
    assert after == before
    assert restarted.cdi.common_spec_path.exists()
    assert env.claims.calls == 0  # no API server needed


def test_prepare_of_a_completed_claim_rewrites_its_lost_spec_without_redoing_it(
    env: Env,
) -> None:
    ref = env.claims.add(make_claim("uid-1", [result("gpu-0")]))
    first = env.prepare_one(ref)
    before = env.state.cdi.claim_spec_path("uid-1").read_bytes()
    journal = env.journal()
    _wipe_cdi_root(env)

    again = env.prepare_one(ref)

    assert again.ok and again.devices == first.devices
    assert env.state.cdi.claim_spec_path("uid-1").read_bytes() == before
    assert env.journal() == journal
    assert env.state.stats.rollbacks == 0 and env.state.stats.prepared == 1


def test_entry_without_stored_spec_is_reported_missing_and_redone(env: Env) -> None:
    ref = env.claims.add(make_claim("uid-1", [result("gpu-0")]))
    devices = env.prepare_one(ref).devices
    legacy = ClaimEntry(ClaimState.PREPARE_COMPLETED, "default", "claim-uid-1", devices)
    Checkpoint(env.data_dir).store({"uid-1": legacy})  # written before specs were stored
    _wipe_cdi_root(env)

    report = env.new_state().recover()
    assert report.recreated_specs == () and report.missing_specs == ("uid-1",)
    res = env.prepare_one(ref)
    assert res.ok and env.state.cdi.claim_spec_exists("uid-1")
    assert env.state.stats.rollbacks == 1


# Scaled down from the plugin's 10 s (`KubeDeviceHealth(sync_timeout=...)`).
TAINT_WAIT = 1.0
# Seconds to wait for what happens at once: only a regression waits this long.
EVENT_WAIT = 30.0


class UnreachableApiPublisher:
    """A `SlicePublisher` whose API server never answers: `wait_synced` fails, as the
    real one does when no reconcile succeeds within its timeout, but only once the
    test calls `end_wait()`, however long that takes. `waiting` is set once a caller
    is inside the wait; `timeouts` records the timeout of each wait."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.wait_over = threading.Event()
        self.timeouts: list[float] = []

    def trigger(self) -> int:
        return 1

    def wait_synced(self, ticket: int, timeout: float) -> bool:
        self.timeouts.append(timeout)
        self.waiting.set()
        self.wait_over.wait(EVENT_WAIT)  # no reconcile succeeds
        return False

    def end_wait(self) -> None:
        self.wait_over.set()


def test_taint_wait_of_a_failed_gpu_does_not_stall_other_claims(env: Env) -> None:
    """During an API outage tainting a failed GPU waits for the API server (10 s in the
    plugin, TAINT_WAIT here); that wait happens outside the node lock, so an unrelated
    claim's prepare and unprepare finish while it is still going on."""
    store = HealthStore(env.data_dir.parent / "health.json")
    store.record_xid(DEVICES["gpu-1"].gpu_uuid, 79)
    publisher = UnreachableApiPublisher()
    health = KubeDeviceHealth(store, publisher, DEVICES, sync_timeout=TAINT_WAIT)
    env.state = env.new_state(health=health)
    failed = env.claims.add(make_claim("uid-f", [result("gpu-1")]))
    healthy = env.claims.add(make_claim("uid-h", [result("gpu-0")]))
    outcome: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: outcome.update(env.state.prepare([failed])))
    waiting.start()
    try:
        assert publisher.waiting.wait(EVENT_WAIT), "the failed claim never started its taint wait"
        prepared = env.prepare_one(healthy)  # the taint wait is held all along
        unprepared = env.state.unprepare([healthy])
    finally:
        publisher.end_wait()
        waiting.join(EVENT_WAIT)
    assert not waiting.is_alive()
    assert prepared.ok, prepared.error
    assert unprepared == {"uid-h": None}
    assert publisher.timeouts == [TAINT_WAIT]
    error = outcome["uid-f"].error
    assert error is not None and not error.permanent
    assert str(error).startswith("device gpu-1 failed (Xid 79 (since "), error
    assert str(error).endswith(
        "but tainting it failed: device gpu-1: the API server has not accepted its taint "
        f"within {TAINT_WAIT:.0f}s; retrying"
    ), error
    assert env.journal() == {}  # the failed claim never reached the journal


# -- consumable capacity: shares of one multi-allocatable device ---------------------------

GIB = 1 << 30


def shareable_devices() -> dict[str, PublishedDevice]:
    """gpu-0 multi-allocatable (40Gi, compute 100); gpu-1 exclusive."""
    gpu0 = PublishedDevice(
        name="gpu-0",
        document={"name": "gpu-0", "allowMultipleAllocations": True},
        gpu_uuid="GPU-aaaa",
        gpu_minor=0,
        is_partition=False,
        max_partitions=None,
        share_capacity={"memory": 40 * GIB, "compute": 100},
    )
    return {"gpu-0": gpu0, "gpu-1": DEVICES["gpu-1"]}


def share(uid: str, share_id: str, memory: str = "16Gi", compute: str = "20") -> dict[str, Any]:
    return make_claim(
        uid,
        [
            result(
                "gpu-0", shareID=share_id, consumedCapacity={"memory": memory, "compute": compute}
            )
        ],
    )


@pytest.fixture
def shared_env(env: Env) -> Env:
    env.state = env.new_state(devices=shareable_devices())
    return env


def test_two_shares_of_one_gpu_get_their_own_cdi_device_env_and_entry(shared_env: Env) -> None:
    env = shared_env
    a, b = env.claims.add(share("uid-a", "s-a")), env.claims.add(share("uid-b", "s-b"))
    out = env.state.prepare([a, b])
    assert out["uid-a"].ok and out["uid-b"].ok, (out["uid-a"].error, out["uid-b"].error)
    for uid, sid in (("uid-a", "s-a"), ("uid-b", "s-b")):
        assert env.spec(uid)["devices"][0]["name"] == f"{uid}-gpu-0-{sid}"
        assert out[uid].devices[0].cdi_device_ids[0] == f"{KIND}={uid}-gpu-0-{sid}"
        assert "GPU_DEVICE_0_MEMORY=16Gi" in env.env_of(uid)
        assert "GPU_DEVICE_0_COMPUTE=20" in env.env_of(uid)
    journal = env.journal()
    assert set(journal) == {"uid-a", "uid-b"}
    assert dict(journal["uid-a"].devices[0].consumed_capacity) == {
        "memory": "16Gi",
        "compute": "20",
    }
    raw = json.loads((env.data_dir / "checkpoint.json").read_text())
    assert raw["entries"]["uid-b"]["devices"][0]["consumedCapacity"] == {
        "compute": "20",
        "memory": "16Gi",
    }
    # Unprepare of one share leaves the other's spec and entry.
    assert env.state.unprepare([a]) == {"uid-a": None}
    assert set(env.journal()) == {"uid-b"}
    assert list(env.state.cdi.list_claim_specs()) == ["uid-b"]
    assert "GPU_DEVICE_0_MEMORY=16Gi" in env.env_of("uid-b")
    # The freed capacity can be shared again.
    c = env.claims.add(share("uid-c", "s-c", memory="24Gi"))
    assert env.prepare_one(c).ok


def test_a_share_beyond_the_capacity_is_refused(shared_env: Env) -> None:
    env = shared_env
    a, b = env.claims.add(share("uid-a", "s-a")), env.claims.add(share("uid-b", "s-b"))
    assert env.prepare_one(a).ok and env.prepare_one(b).ok
    over = env.claims.add(share("uid-c", "s-c"))  # 48Gi of 40Gi
    err = env.prepare_one(over).error
    assert err is not None and not err.permanent
    assert "memory" in str(err) and "default/claim-uid-a" in str(err), err
    compute = env.claims.add(share("uid-d", "s-d", memory="1Gi", compute="61"))
    err = env.prepare_one(compute).error
    assert err is not None and "compute" in str(err), err
    fits = env.claims.add(share("uid-e", "s-e", memory="8Gi", compute="60"))
    assert env.prepare_one(fits).ok
    assert set(env.journal()) == {"uid-a", "uid-b", "uid-e"}


def test_capacity_counts_the_journal_and_the_claims_of_the_same_request(
    shared_env: Env,
) -> None:
    env = shared_env
    a = env.claims.add(share("uid-a", "s-a"))
    assert env.prepare_one(a).ok
    b, c = env.claims.add(share("uid-b", "s-b")), env.claims.add(share("uid-c", "s-c"))
    out = env.state.prepare([b, c])
    assert out["uid-b"].ok
    err = out["uid-c"].error
    assert err is not None and "default/claim-uid-b" in str(err), err
    # Two shares of one device in one claim count together.
    d = env.claims.add(
        make_claim(
            "uid-d",
            [
                result("gpu-0", "r1", shareID="s-1", consumedCapacity={"memory": "4Gi"}),
                result("gpu-0", "r2", shareID="s-2", consumedCapacity={"memory": "5Gi"}),
            ],
        )
    )
    err = env.prepare_one(d).error  # 32Gi held + 9Gi > 40Gi
    assert err is not None and "memory" in str(err), err


def test_a_share_without_recorded_consumption_counts_as_the_whole_device(
    shared_env: Env,
) -> None:
    env = shared_env
    whole = env.claims.add(make_claim("uid-w", [result("gpu-0", shareID="s-w")]))
    assert env.prepare_one(whole).ok
    small = env.claims.add(share("uid-s", "s-s", memory="1Gi", compute="1"))
    assert env.prepare_one(small).error is not None


def test_an_exclusive_allocation_of_a_shared_device_is_refused(shared_env: Env) -> None:
    env = shared_env
    a = env.claims.add(share("uid-a", "s-a"))
    assert env.prepare_one(a).ok
    exclusive = env.claims.add(make_claim("uid-x", [result("gpu-0")]))
    err = env.prepare_one(exclusive).error
    assert err is not None and "overlaps" in str(err), err
