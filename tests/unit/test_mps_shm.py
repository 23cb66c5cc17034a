"""A bounded /dev/shm for each MPS daemon and its clients (issue 44, item 6;
docs/mps.md, "Directories, users and /dev/shm"): the plugin mounts a tmpfs of
--mps-shm-size on the daemon's shm directory before the daemon starts, keeps it when
the daemon is started again, and unmounts it before the directory goes: at
unprepare, at the rollback of a failed prepare, at the start's recovery of a
journaled claim and at the sweep of a directory no claim owns. Where the plugin may
not mount (EPERM) or its mount would not reach the node, the directory stays plain
and the plugin says so once. The mount calls are a fake here but in the last tests,
which make them for real where the kernel lets this process."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from driver.devices.model import build_pool
from driver.errors import DriverError
from driver.nvml.mps import DaemonDirs, DaemonId, MpsControl
from driver.plugin.options.flags import parse_options
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.journal.journal_entries import boot_id
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemons import NodeDaemons, daemon_dirs
from driver.state.mps.orphans import sweep_orphans
from driver.state.mps.shm import (
    MOUNT_FLAGS,
    HostMounts,
    ShmBound,
    parse_mountinfo,
    shm_size,
)
from driver.state.prepare import DeviceState
from tests.state_fakes import device_state
from tests.unit.test_mps_prepare import Node, mps_node, ok
from tests.unit.test_mps_watch import kill

SIZE = 64 << 20
OPTIONS = f"size={SIZE},mode=1777"
Event = tuple[object, ...]


class FakeMounts:
    """`Mounts` as a table of mount points; each call an event."""

    def __init__(self, events: list[Event], *, refuse: int = 0, shared: bool = True) -> None:
        self.events = events
        self.table: list[Path] = []
        self.refuse = refuse
        self.shared = shared

    def mount_tmpfs(self, target: Path, flags: int, options: str) -> None:
        self.events.append(("mount", target, flags, options))
        if self.refuse:
            raise OSError(self.refuse, os.strerror(self.refuse))
        self.table.append(target)

    def unmount(self, target: Path) -> None:
        self.events.append(("unmount", target))
        self.table.remove(target)

    def mounted(self, target: Path) -> bool:
        return target in self.table

    def propagates(self, target: Path) -> bool:
        return self.shared


class RecordingControl(MpsControl):
    """The mock's daemon binary; each start an event (after the mounts' events)."""

    def __init__(self, driver_root: Path, events: list[Event], *, fail: bool = False) -> None:
        super().__init__(driver_root)
        self.events = events
        self.fail = fail

    def start(
        self, dirs: DaemonDirs, gpu_uuids: Sequence[str], *, multi_user: bool = False
    ) -> DaemonId:
        self.events.append(("start", dirs.shm))
        if self.fail:
            from driver.errors import transient

            raise transient("the daemon did not start")
        return super().start(dirs, gpu_uuids)


class ShmNode:
    """A node whose plugin mounts through `mounts` (node daemons of the mock)."""

    def __init__(self, node: Node, mounts: FakeMounts) -> None:
        self.node = node
        self.mounts = mounts
        self.shm = ShmBound(SIZE, mounts)
        self.fail_start = False

    def state(self) -> DeviceState:
        control = RecordingControl(self.node.control.driver_root, self.mounts.events)
        control.fail = self.fail_start
        state = device_state(
            self.node.root,
            self.node.claims,
            mig=self.node.backend.mig(),
            mps_daemons=NodeDaemons(control, shm=self.shm),
        )
        self.node.report = state.recover()
        pool = build_pool(self.node.backend.discover(), self.node.options)
        state.devices = {d.name: d for d in pool.devices}
        return state

    def shm_dir(self, record: MpsRecord) -> Path:
        shm = daemon_dirs(self.node.root / "plugin" / "mps", record).shm
        assert shm is not None
        return shm


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(tmp_path)


@pytest.fixture
def events() -> list[Event]:
    return []


@pytest.fixture
def site(node: Node, events: list[Event]) -> ShmNode:
    return ShmNode(node, FakeMounts(events))


def test_prepare_mounts_a_sized_tmpfs_before_the_daemon_starts(site: ShmNode) -> None:
    state = site.state()
    ok(state, site.node.claims.add("a"))
    shm = site.shm_dir(site.node.record("a"))
    assert site.mounts.events == [("mount", shm, MOUNT_FLAGS, OPTIONS), ("start", shm)]
    assert site.mounts.table == [shm]
    assert OPTIONS == "size=67108864,mode=1777"
    assert MOUNT_FLAGS == os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC


def test_unprepare_unmounts_it_before_the_directory_goes(site: ShmNode) -> None:
    state = site.state()
    ref = site.node.claims.add("a")
    ok(state, ref)
    shm = site.shm_dir(site.node.record("a"))

    assert state.unprepare([ref]) == {"a": None}

    assert site.mounts.events[-1] == ("unmount", shm)
    assert site.mounts.table == []
    assert not shm.parent.exists()


def test_a_failed_prepare_leaves_nothing_mounted_or_on_disk(site: ShmNode) -> None:
    site.fail_start = True
    state = site.state()
    results = state.prepare([site.node.claims.add("a")])
    assert not results["a"].ok and "the daemon did not start" in str(results["a"].error)
    kinds = [e[0] for e in site.mounts.events]
    assert kinds == ["mount", "start", "unmount"], site.mounts.events
    assert site.mounts.table == []
    assert list((site.node.root / "plugin" / "mps").iterdir()) == []
    assert "a" not in Checkpoint(site.node.root / "plugin").load()


def test_the_start_rolls_back_a_journaled_intent_and_unmounts_its_tmpfs(site: ShmNode) -> None:
    """A plugin killed after the daemon started, before the claim's PrepareCompleted:
    the next start finds the intent and rolls it back."""
    state = site.state()
    ok(state, site.node.claims.add("a"))
    record = site.node.record("a")
    journal = Checkpoint(site.node.root / "plugin").load()
    journal["a"] = replace(journal["a"], state=ClaimState.PREPARE_STARTED)
    state.checkpoint.store(journal)

    site.state()  # the plugin's next start

    assert site.node.report.rolled_back == ("a",), site.node.report
    assert site.mounts.events[-1] == ("unmount", site.shm_dir(record))
    assert site.mounts.table == []
    assert not (site.node.root / "plugin" / "mps" / record.directory).exists()
    assert site.node.daemons() == []


def test_the_start_finishes_a_begun_unprepare_and_unmounts_its_tmpfs(site: ShmNode) -> None:
    """A plugin killed during an unprepare, after the claim's CDI spec went."""
    state = site.state()
    ok(state, site.node.claims.add("a"))
    record = site.node.record("a")
    journal = Checkpoint(site.node.root / "plugin").load()
    journal["a"] = replace(journal["a"], unpreparing=boot_id())  # as unprepare marks it
    state.checkpoint.store(journal)
    state.cdi.claim_spec_path("a").unlink()

    site.state()

    assert "a" not in Checkpoint(site.node.root / "plugin").load()
    assert site.mounts.events[-1] == ("unmount", site.shm_dir(record))
    assert site.mounts.table == []
    assert site.node.daemons() == []


def test_a_daemon_started_again_keeps_the_tmpfs_its_clients_hold(site: ShmNode) -> None:
    ok(site.state(), site.node.claims.add("a"))
    killed = site.node.record("a")
    shm = site.shm_dir(killed)
    (shm / "client-file").write_text("x")  # what the fake's tmpfs holds
    kill(killed)  # and wait until it is gone: a signal is not yet an exit

    site.state()  # the start finds it gone and starts it again

    assert site.node.report.mps_lost == ("a",)
    assert [e[0] for e in site.mounts.events] == ["mount", "start", "start"]
    assert site.mounts.table == [shm]
    assert list(shm.iterdir()) == []  # emptied, not replaced


def test_where_the_plugin_may_not_mount_the_directory_stays_plain_and_it_says_so_once(
    node: Node, events: list[Event], caplog: pytest.LogCaptureFixture
) -> None:
    site = ShmNode(node, FakeMounts(events, refuse=errno.EPERM))
    state = site.state()
    with caplog.at_level(logging.WARNING, logger="driver.state.mps.shm"):
        ok(state, node.claims.add("a"))
        shm = site.shm_dir(node.record("a"))
        assert shm.is_dir() and oct(shm.stat().st_mode & 0o7777) == "0o1777"
        assert state.unprepare([node.claims.add("a")]) == {"a": None}
        ok(state, node.claims.add("b"))
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "driver.state.mps.shm"
    ]
    assert len(warnings) == 1, warnings
    assert "not bounded" in warnings[0] and "EPERM" in warnings[0], warnings[0]
    assert [e[0] for e in events] == ["mount", "start", "start"]  # tried once
    assert site.shm.unbounded is not None and "EPERM" in site.shm.unbounded

    assert state.unprepare([node.claims.add("b")]) == {"b": None}
    assert [e[0] for e in events] == ["mount", "start", "start"]  # nothing to unmount
    assert list((node.root / "plugin" / "mps").iterdir()) == []


def test_another_mount_error_fails_the_prepare(node: Node, events: list[Event]) -> None:
    site = ShmNode(node, FakeMounts(events, refuse=errno.ENOMEM))
    results = site.state().prepare([node.claims.add("a")])
    assert not results["a"].ok
    assert "tmpfs" in str(results["a"].error), results["a"].error
    assert [e[0] for e in events] == ["mount"]  # no daemon started
    assert list((node.root / "plugin" / "mps").iterdir()) == []


def test_a_mount_that_cannot_go_keeps_the_claim(site: ShmNode) -> None:
    state = site.state()
    ref = site.node.claims.add("a")
    ok(state, ref)
    shm = site.shm_dir(site.node.record("a"))

    def busy(target: Path) -> None:
        raise OSError(errno.EBUSY, "busy")

    site.mounts.unmount = busy  # type: ignore[method-assign]
    assert state.unprepare([ref])["a"] is not None
    assert "a" in Checkpoint(site.node.root / "plugin").load()
    assert shm.is_dir()  # the directory stays with its mount: the kubelet repeats


def test_in_a_pod_a_mount_that_would_not_reach_the_node_is_not_made(
    tmp_path: Path, events: list[Event], caplog: pytest.LogCaptureFixture
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    private = FakeMounts(events, shared=False)
    with caplog.at_level(logging.WARNING, logger="driver.state.mps.shm"):
        assert ShmBound(SIZE, private, needs_propagation=True).apply(shm) is False
    assert events == []
    assert "Bidirectional" in caplog.text
    shared = FakeMounts(events)
    assert ShmBound(SIZE, shared, needs_propagation=True).apply(shm) is True
    assert events == [("mount", shm, MOUNT_FLAGS, OPTIONS)]


def test_size_zero_turns_the_tmpfs_off_but_still_unmounts(
    tmp_path: Path, events: list[Event]
) -> None:
    shm = tmp_path / "shm"
    mounts = FakeMounts(events)
    mounts.table.append(shm)  # mounted under an earlier setting
    off = ShmBound(0, mounts)
    mounts.table.clear()
    assert off.apply(shm) is False and events == []
    mounts.table.append(shm)
    off.release(shm)
    assert events == [("unmount", shm)] and mounts.table == []


def test_the_sweep_unmounts_an_orphan_directory_before_removing_it(
    tmp_path: Path, events: list[Event]
) -> None:
    root = tmp_path / "mps"
    record = MpsRecord("", "0123456789abcdef")
    dirs = daemon_dirs(root, record)
    assert dirs.shm is not None
    for directory in (dirs.pipe, dirs.log, dirs.shm):
        directory.mkdir(parents=True)
    mounts = FakeMounts(events)
    mounts.table.append(dirs.shm)
    shm = ShmBound(SIZE, mounts)

    (removed,) = sweep_orphans(root, {}, [NodeDaemons(MpsControl(tmp_path / "none"), shm=shm)], shm)

    assert removed.kind == "directory"
    assert events == [("unmount", dirs.shm)] and mounts.table == []
    assert not (root / record.directory).exists()


def test_the_size_is_a_setting_with_a_documented_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPS_SHM_SIZE", raising=False)
    assert parse_options(["--node-name", "n"]).mps_shm_size == 1 << 30
    monkeypatch.setenv("MPS_SHM_SIZE", "256Mi")
    assert parse_options(["--node-name", "n"]).mps_shm_size == 256 << 20
    assert shm_size("0") == 0
    for bad in ("1k", "abc", "1.5", "-1Gi"):
        with pytest.raises(ValueError):
            shm_size(bad)


def test_the_mountinfo_tells_mount_points_and_propagation(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        "30 22 0:40 / /data rw,relatime master:3 - ext4 /dev/sdb1 rw\n"
        "31 30 0:41 / /data/a\\040b/shm rw,nosuid shared:9 - tmpfs gpu-dra-mps-shm rw\n"
        "32 22 0:42 / /shared rw shared:5 master:2 - ext4 /dev/sdc1 rw\n"
    )
    table = parse_mountinfo(mountinfo.read_text())
    assert table[2] == ("/data/a b/shm", ("shared:9",))
    mounts = HostMounts(mountinfo)
    assert mounts.mounted(Path("/data/a b/shm"))
    assert not mounts.mounted(Path("/data/a b"))
    assert not mounts.propagates(Path("/data/mps/d/shm"))  # /data is a slave only
    assert mounts.propagates(Path("/shared/mps/d/shm"))
    assert mounts.propagates(Path("/var/lib/x/shm"))  # / is shared


def _unmount_all(path: Path) -> None:
    for _ in range(8):
        if not HostMounts().mounted(path):
            return
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_the_kernel_bounds_the_tmpfs_or_the_plugin_says_why_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """For real: a 1 MiB tmpfs with mode 1777 that takes no more than 1 MiB, then
    gone; where this process may not mount, the plain directory and the warning."""
    shm = tmp_path / "shm"
    shm.mkdir()
    bound = ShmBound(1 << 20, HostMounts())
    try:
        with caplog.at_level(logging.WARNING, logger="driver.state.mps.shm"):
            mounted = bound.apply(shm)
        if not mounted:
            assert "EPERM" in caplog.text, caplog.text
            assert not HostMounts().mounted(shm)
            return
        assert HostMounts().mounted(shm)
        assert bound.apply(shm) is True  # not stacked
        table = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
        assert [p for p, _ in table].count(os.path.realpath(shm)) == 1
        assert oct(shm.stat().st_mode & 0o7777) == "0o1777"
        fs = os.statvfs(shm)
        assert fs.f_blocks * fs.f_frsize == 1 << 20
        assert fs.f_flag & MOUNT_FLAGS == MOUNT_FLAGS
        with pytest.raises(OSError) as full:
            (shm / "big").write_bytes(b"\0" * (2 << 20))
        assert full.value.errno == errno.ENOSPC
        bound.release(shm)
        assert not HostMounts().mounted(shm)
        assert not (shm / "big").exists()  # the directory's own content again
    finally:
        _unmount_all(shm)


def test_release_raises_when_the_kernel_keeps_the_mount(tmp_path: Path) -> None:
    events: list[Event] = []
    mounts = FakeMounts(events)
    shm = tmp_path / "shm"
    mounts.table.append(shm)

    def refuse(target: Path) -> None:
        raise OSError(errno.EPERM, "not permitted")

    mounts.unmount = refuse  # type: ignore[method-assign]
    with pytest.raises(DriverError, match="unmounting the tmpfs"):
        ShmBound(SIZE, mounts).release(shm)


def test_a_daemon_started_again_on_a_plain_directory_gets_no_tmpfs_over_it(
    node: Node, events: list[Event]
) -> None:
    """A claim prepared where the plugin could not mount (or before this release):
    its containers hold the plain directory, so a daemon started again stays on it."""
    refused = ShmNode(node, FakeMounts(events, refuse=errno.EPERM))
    ok(refused.state(), node.claims.add("a"))
    killed = node.record("a")
    kill(killed)  # and wait until it is gone: a signal is not yet an exit
    mounting = ShmNode(node, FakeMounts(events))  # a plugin that may mount now

    mounting.state()

    assert node.report.mps_lost == ("a",)
    assert [e[0] for e in events] == ["mount", "start", "start"]  # no second mount
    assert mounting.mounts.table == []
