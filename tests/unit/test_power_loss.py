"""A power loss keeps what was fsynced and nothing else: nothing the kubelet was told
is lost (docs/state.md, "Durability").

The journal is the source of truth and claim specs are derived from it: a claim spec
is written and removed without a fsync, a whole-GPU or share claim journals no intent,
and start-up rewrites a spec a power loss took or garbled and removes one no entry
owns. `Disk` records what reached the disk: each fsync or fdatasync of a file makes
that inode's content durable, each fsync of a directory its listing. A power loss is
modelled at both extremes a file system allows: every rename and unlink since a
directory's last fsync undone (`lost`), or all of them kept with only the fsynced
contents (`kept`). The journal's log, the one file appended to in place, keeps what
was synced and of the bytes appended since nothing (`lost`), all (`kept`) or a part
cut at any byte (`torn`).
After every step of a kubelet's sequence the node loses power, restarts (`recover()`)
and must hold exactly the claims the kubelet was told are prepared, each with the spec
its journal entry stores, and no other spec.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from driver.cdi.claim_specs import ClaimSpec
from driver.state.journal.checkpoint import Checkpoint, ClaimEntry, ClaimState, PreparedDevice
from driver.state.recovery.quarantine import quarantine_checkpoint
from driver.state.request import ClaimRef
from tests.unit.test_mig_prepare import Node, make_node

LOG_FILE = "checkpoint.log"  # the journal's log, appended to in place

# MIG off: whole GPUs and shares, the claims whose prepare journals no intent.
FLEET = {"gpus": [{"model": "H100-80GB", "count": 3, "migMode": "disabled"}]}

Listing = dict[str, tuple[int, bytes]]  # name -> (inode, content)


class Disk:
    """What of the watched directories reached the disk (see the module doc)."""

    def __init__(self, directories: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
        self.directories = directories
        self.durable_content: dict[int, bytes] = {}  # inode -> content at its last fsync
        self.synced: dict[Path, Listing] = {}  # directory -> listing at its last fsync
        for directory in directories:
            directory.mkdir(parents=True, exist_ok=True)
            for listing in self._listing(directory).values():
                self.durable_content[listing[0]] = listing[1]
            self.synced[directory] = self._listing(directory)
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self._recording(getattr(os, name)))

    def _recording(self, real: Callable[[int], None]) -> Callable[[int], None]:
        def recording(fd: int) -> None:
            real(fd)
            path = Path(os.readlink(f"/proc/self/fd/{fd}"))
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                if path in self.synced:
                    self.synced[path] = self._listing(path)
            elif path.parent in self.synced:
                self.durable_content[os.fstat(fd).st_ino] = path.read_bytes()

        return recording

    @staticmethod
    def _listing(directory: Path) -> Listing:
        return {
            p.name: (p.stat().st_ino, p.read_bytes())
            for p in directory.iterdir()
            if p.is_file() and not p.is_symlink()
        }

    def after_power_loss(
        self, renames: str, appended: str = "lost", cut: int | None = None
    ) -> dict[Path, dict[str, bytes]]:
        """Each directory as a restart finds it: names from the last fsync of the
        directory (`lost`) or as they are now (`kept`); contents as last fsynced (a
        file never fsynced comes back empty), but for the journal's log: of what was
        `appended` since its last sync, nothing (`lost`), all (`kept`), or the first
        `cut` bytes, half by default (`torn`)."""
        out: dict[Path, dict[str, bytes]] = {}
        now = {d: self._listing(d) for d in self.directories}
        for directory in self.directories:
            names = self.synced[directory] if renames == "lost" else now[directory]
            current = {inode: data for inode, data in now[directory].values()}
            out[directory] = {
                name: self._content(inode, current.get(inode), appended, cut)
                if name == LOG_FILE
                else self.durable_content.get(inode, b"")
                for name, (inode, _) in names.items()
            }
        return out

    def _content(self, inode: int, current: bytes | None, appended: str, cut: int | None) -> bytes:
        durable = self.durable_content.get(inode, b"")
        if current is None or not current.startswith(durable) or appended == "lost":
            return durable
        unsynced = current[len(durable) :]
        if appended == "torn":
            unsynced = unsynced[: len(unsynced) // 2 if cut is None else cut]
        return durable + unsynced


def _restore(files: dict[Path, dict[str, bytes]], root: Path, into: Path) -> None:
    for directory, contents in files.items():
        target = into / directory.relative_to(root)
        target.mkdir(parents=True, exist_ok=True)
        for name, data in contents.items():
            (target / name).write_bytes(data)


def _claim(node: Node, uid: str, device: str) -> ClaimRef:
    return node.claims.add(uid, device)


def _check_restart(
    node: Node, disk: Disk, prepared: set[str], tmp_path: Path, renames: str, appended: str
) -> None:
    """Power lost now: a restart holds exactly `prepared`, each spec as its entry says."""
    files = disk.after_power_loss(renames, appended)
    into = tmp_path / f"restart-{len(list(tmp_path.iterdir()))}"
    _restore(files, node.root, into)
    shutil.copytree(node.root / "driver-root", into / "driver-root")
    again = make_node(into, FLEET)  # make_node runs recover(), as the plugin's start
    journal = Checkpoint(into / "plugin").load()
    assert set(journal) == prepared
    assert all(e.state is ClaimState.PREPARE_COMPLETED for e in journal.values())
    assert set(again.state.cdi.list_claim_specs()) == prepared
    for uid, entry in journal.items():
        assert entry.cdi_spec is not None and again.state.cdi.claim_spec_is(uid, entry.cdi_spec)


Step = Callable[[Node], None]


def _steps() -> list[tuple[str, Step, set[str]]]:
    """A kubelet's calls and, after each, the claims it was told are prepared."""

    def prepare(*pairs: tuple[str, str]) -> Step:
        def run(node: Node) -> None:
            refs = [_claim(node, uid, device) for uid, device in pairs]
            assert all(r.ok for r in node.state.prepare(refs).values())

        return run

    def unprepare(*uids: str) -> Step:
        def run(node: Node) -> None:
            refs = [ClaimRef("default", f"claim-{uid}", uid) for uid in uids]
            assert node.state.unprepare(refs) == dict.fromkeys(uids)

        return run

    def common_spec(node: Node) -> None:  # a durable write to the CDI root (a refresh)
        node.state.cdi.write_common_spec("node-a")

    return [
        ("prepare a", prepare(("a", "gpu-0")), {"a"}),
        ("common spec", common_spec, {"a"}),
        ("prepare b, c", prepare(("b", "gpu-1"), ("c", "gpu-2")), {"a", "b", "c"}),
        ("unprepare a", unprepare("a"), {"b", "c"}),
        ("common spec", common_spec, {"b", "c"}),
        ("unprepare b", unprepare("b"), {"c"}),
        ("prepare a again", prepare(("a", "gpu-0")), {"a", "c"}),
    ]


@pytest.mark.parametrize("appended", ["lost", "torn", "kept"])
@pytest.mark.parametrize("renames", ["lost", "kept"])
def test_a_power_loss_after_any_answer_loses_nothing_owed(
    renames: str, appended: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(tmp_path / "node", FLEET)
    disk = Disk([node.root / "cdi", node.root / "plugin"], monkeypatch)
    restarts = tmp_path / "restarts"
    restarts.mkdir()
    for _, step, prepared in _steps():
        step(node)
        _check_restart(node, disk, prepared, restarts, renames, appended)
    assert json.loads(Checkpoint(node.root / "plugin").path.read_bytes())["schemaVersion"] == 2
    assert (node.root / "plugin" / LOG_FILE).read_bytes().count(b"\n") >= 4  # appended


def _entry(name: str) -> ClaimEntry:
    device = PreparedDevice("node-a", f"gpu-{name}", ("gpu",), (f"k8s.x/gpu={name}",))
    return ClaimEntry(ClaimState.PREPARE_COMPLETED, "default", f"claim-{name}", (device,))


def test_a_torn_append_after_acknowledged_stores_loses_nothing_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unsynced store (an intent) torn by a power loss at any byte: the restart reads
    the acknowledged journal, or the whole new store, never an error; and appends after
    the torn record as if it had never been written."""
    data_dir = tmp_path / "plugin"
    data_dir.mkdir()
    disk = Disk([data_dir], monkeypatch)
    cp = Checkpoint(data_dir)
    acknowledged = {"a": _entry("a"), "b": _entry("b")}
    cp.store({"a": _entry("a")})
    cp.store(acknowledged)
    cp.store({"b": _entry("b"), "c": _entry("c")}, sync=False)
    durable = disk.durable_content[(data_dir / LOG_FILE).stat().st_ino]
    unsynced = len((data_dir / LOG_FILE).read_bytes()) - len(durable)
    assert unsynced > 0
    for cut in range(unsynced + 1):
        files = disk.after_power_loss("lost", "torn", cut)
        restart = tmp_path / f"restart-{cut}"
        _restore(files, tmp_path, restart)
        again = Checkpoint(restart / "plugin")
        whole = cut == unsynced
        assert again.load() == ({"b": _entry("b"), "c": _entry("c")} if whole else acknowledged)
        again.store({**again.load(), "d": _entry("d")})
        assert set(Checkpoint(restart / "plugin").load()) == (
            {"b", "c", "d"} if whole else {"a", "b", "d"}
        )


def test_the_model_loses_what_was_not_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The oracle itself: a spec that was never fsynced comes back empty or not at all."""
    node = make_node(tmp_path / "node", FLEET)
    disk = Disk([node.root / "cdi"], monkeypatch)
    node.state.cdi.write_claim_spec("x", ClaimSpec(()))
    kept = disk.after_power_loss("kept")[node.root / "cdi"]
    assert kept[node.state.cdi.claim_spec_path("x").name] == b""
    assert (
        node.state.cdi.claim_spec_path("x").name
        not in disk.after_power_loss("lost")[node.root / "cdi"]
    )
    node.state.cdi.write_common_spec("node-a")  # fsyncs the CDI root: the name survives
    lost = disk.after_power_loss("lost")[node.root / "cdi"]
    assert lost[node.state.cdi.claim_spec_path("x").name] == b""
    assert lost[node.state.cdi.common_spec_path.name] != b""


def test_specs_of_claims_a_quarantined_journal_knew_are_kept(tmp_path: Path) -> None:
    """After `gpu-dra journal quarantine` the claims prepared before have specs but no
    entry: their pods still run, and a container restart needs the spec. Any other
    spec without an entry is removed."""
    node = make_node(tmp_path, FLEET)
    assert node.state.prepare([_claim(node, "a", "gpu-0")])["a"].ok
    path = node.root / "plugin" / "checkpoint.json"
    path.write_bytes(path.read_bytes().replace(b'"checksum":"sha256:', b'"checksum":"sha256:0'))
    assert quarantine_checkpoint(node.root / "plugin") is not None
    restarted = make_node(tmp_path, FLEET)  # the plugin's start after the quarantine
    restarted.state.cdi.write_claim_spec("stray", ClaimSpec(()))
    report = restarted.state.recover()
    assert report.orphan_specs == ("a",) and report.removed_specs == ("stray",)
    assert set(restarted.state.cdi.list_claim_specs()) == {"a"}
