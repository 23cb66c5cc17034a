"""`gpu-dra journal show|quarantine` on a plugin data directory."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from driver.cdi.claim_specs import CdiSpecs, ClaimSpec
from driver.cli import build_parser
from driver.cli.state_dir import node_path
from driver.plugin.serving_instance import InstanceLock
from driver.state.journal.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    ClaimEntry,
    ClaimState,
    MigRecord,
    PreparedDevice,
)

DRIVER = "gpu.example.com"
UID_A = "0b7c4a52-0000-4000-8000-00000000000a"
UID_B = "0b7c4a52-0000-4000-8000-00000000000b"
MIG = MigRecord("GPU-0", 19, 1, (3, 1), owned=True, gi_id=9, ci_id=0, uuid="MIG-1")
ENTRIES = {
    UID_A: ClaimEntry(
        ClaimState.PREPARE_COMPLETED,
        "team-a",
        "claim-a",
        (PreparedDevice("node-1", "gpu-0-mig-1g10gb-3", ("r",), ("k8s.x/gpu=a",), mig=MIG),),
        ClaimSpec(devices=()),
    ),
    UID_B: ClaimEntry(
        ClaimState.PREPARE_STARTED,
        "team-b",
        "claim-b",
        (PreparedDevice("node-1", "gpu-1", ("r",), ("k8s.x/gpu=b",)),),
    ),
}


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def gpu_dra(argv: list[str], stdin: io.StringIO | None = None) -> tuple[int, str, str]:
    args = build_parser().parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    if args.journal_action == "quarantine":
        code = args.run(args, out=out, err=err, stdin=stdin or io.StringIO())
    else:
        code = args.run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    path = tmp_path / "plugin"
    path.mkdir()
    return path


def show(data_dir: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    code, out, err = gpu_dra(
        ["journal", "show", "--state-dir", str(data_dir), "-o", "json", *extra]
    )
    return code, json.loads(out), err


def corrupt(data_dir: Path) -> bytes:
    Checkpoint(data_dir).store(ENTRIES)
    path = data_dir / CHECKPOINT_FILE
    data = path.read_bytes().replace(b"claim-a", b"claim-x")  # checksum no longer matches
    path.write_bytes(data)
    return data


def test_show_absent_journal(data_dir: Path) -> None:
    code, report, err = show(data_dir)
    assert (code, err) == (0, "")
    assert (report["status"], report["entries"]) == ("absent", [])


def test_show_valid_journal_json(data_dir: Path, tmp_path: Path) -> None:
    Checkpoint(data_dir).store(ENTRIES)
    cdi_root = tmp_path / "cdi"
    cdi_root.mkdir()
    CdiSpecs(cdi_root, DRIVER).claim_spec_path(UID_A).write_text("{}")
    code, report, _ = show(data_dir, "--cdi-root", str(cdi_root))
    assert code == 0
    assert (report["status"], report["verified"], report["problem"]) == ("ok", True, None)
    entries = {e["uid"]: e for e in report["entries"]}
    a, b = entries[UID_A], entries[UID_B]
    assert (a["namespace"], a["name"], a["state"]) == ("team-a", "claim-a", "PrepareCompleted")
    assert (a["cdiSpecStored"], a["cdiSpecPresent"], a["verdict"]) == (True, True, "prepared")
    assert a["devices"][0]["mig"] == MIG.to_json()
    assert b["state"] == "PrepareStarted" and "rolled back" in b["verdict"]
    assert b["cdiSpecPresent"] is False
    assert [e["uid"] for e in report["entries"]] == [UID_A, UID_B]


def test_show_table(data_dir: Path) -> None:
    Checkpoint(data_dir).store(ENTRIES)
    code, out, _ = gpu_dra(["journal", "show", "--state-dir", str(data_dir)])
    assert code == 0
    assert out.splitlines()[0].split()[:3] == ["CLAIM", "UID", "STATE"]
    assert "gpu-0-mig-1g10gb-3 (MIG created GI 9/CI 0 at 3+1)" in out
    assert "valid, 2 claim(s)" in out


def test_show_corrupt_journal(data_dir: Path) -> None:
    corrupt(data_dir)
    code, report, err = show(data_dir)
    assert code == 1 and "is corrupt" in err
    assert report["status"] == "corrupt" and report["verified"] is False
    assert "checksum mismatch" in report["problem"]
    assert {e["name"] for e in report["entries"]} == {"claim-x", "claim-b"}  # as stored
    code, out, _ = gpu_dra(["journal", "show", "--state-dir", str(data_dir)])
    assert "CORRUPT" in out and "UNVERIFIED" in out and "gpu-dra journal quarantine" in out


def test_show_garbage_journal(data_dir: Path) -> None:
    (data_dir / CHECKPOINT_FILE).write_text("not json")
    code, report, _ = show(data_dir)
    assert code == 1 and report["status"] == "corrupt" and report["entries"] == []
    assert "not valid JSON" in report["problem"]


def quarantine(data_dir: Path, *extra: str, stdin: io.StringIO | None = None) -> Any:
    argv = ["journal", "quarantine", "--state-dir", str(data_dir), "--owned-mig", "foreign"]
    return gpu_dra([*argv, *extra], stdin)


def test_quarantine_refuses_without_a_terminal_and_without_yes(data_dir: Path) -> None:
    data = corrupt(data_dir)
    code, out, err = quarantine(data_dir)
    assert code == 1 and "refusing without --yes" in err
    assert "On its next start the kubelet plugin" in out  # explained before asking
    assert (data_dir / CHECKPOINT_FILE).read_bytes() == data


def test_quarantine_not_confirmed_at_a_terminal(data_dir: Path) -> None:
    data = corrupt(data_dir)
    code, out, err = quarantine(data_dir, stdin=Tty("no\n"))
    assert code == 1 and "Move it aside? [y/N]" in out and "not confirmed" in err
    assert (data_dir / CHECKPOINT_FILE).read_bytes() == data


@pytest.mark.parametrize("how", [("--yes",), ()])
def test_quarantine_moves_the_file_aside(data_dir: Path, how: tuple[str, ...]) -> None:
    data = corrupt(data_dir)
    code, out, err = quarantine(data_dir, *how, stdin=Tty("y\n"))
    assert (code, err) == (0, "")
    assert not (data_dir / CHECKPOINT_FILE).exists()
    (moved,) = Checkpoint(data_dir).corrupt_copies()
    assert moved.read_bytes() == data  # kept, byte for byte
    assert f"moved aside: {moved}" in out
    assert Checkpoint(data_dir).load() == {}  # what the plugin reads next
    code, report, _ = show(data_dir)
    assert code == 0 and report["corruptCopies"] == [str(moved)]


def test_quarantine_refuses_a_valid_journal(data_dir: Path) -> None:
    Checkpoint(data_dir).store(ENTRIES)
    code, _, err = quarantine(data_dir, "--yes")
    assert code == 1 and "is valid: not moving it" in err
    assert Checkpoint(data_dir).load() == ENTRIES


def test_quarantine_without_a_journal(data_dir: Path) -> None:
    code, out, _ = quarantine(data_dir, "--yes")
    assert code == 0 and "nothing to move aside" in out


def test_quarantine_refuses_while_a_plugin_runs(data_dir: Path) -> None:
    data = corrupt(data_dir)
    running = InstanceLock(data_dir)
    try:
        code, _, err = quarantine(data_dir, "--yes")
    finally:
        running.release(on_last=lambda: None)
    assert code == 1 and "a kubelet plugin is running on this node" in err
    assert (data_dir / CHECKPOINT_FILE).read_bytes() == data
    code, _, _ = quarantine(data_dir, "--yes")  # the lock is free again
    assert code == 0 and not (data_dir / CHECKPOINT_FILE).exists()


@pytest.mark.parametrize("action", [["show"], ["quarantine", "--yes"]])
def test_missing_state_dir(tmp_path: Path, action: list[str]) -> None:
    code, _, err = gpu_dra(["journal", *action, "--state-dir", str(tmp_path / "nope")])
    assert code == 1 and "no plugin data directory" in err


def test_show_replays_the_log_and_counts_its_pending_records(data_dir: Path) -> None:
    journal = Checkpoint(data_dir)
    journal.store({UID_A: ENTRIES[UID_A]})
    journal.store(ENTRIES)  # appended: claim-b is only in the log
    journal.store({UID_B: ENTRIES[UID_B]})  # claim-a's entry dropped in the log
    code, report, _ = show(data_dir)
    assert code == 0 and report["status"] == "ok"
    assert [e["uid"] for e in report["entries"]] == [UID_B]
    assert (report["schemaVersion"], report["pendingLogRecords"]) == (2, 2)
    code, out, _ = gpu_dra(["journal", "show", "--state-dir", str(data_dir)])
    assert "valid, 1 claim(s)" in out and "2 record(s) pending" in out
    journal.compact()
    code, report, _ = show(data_dir)
    assert (report["schemaVersion"], report["pendingLogRecords"]) == (1, 0)
    assert [e["uid"] for e in report["entries"]] == [UID_B]


def test_a_corrupt_log_is_shown_with_its_line_and_moved_aside_with_the_snapshot(
    data_dir: Path,
) -> None:
    journal = Checkpoint(data_dir)
    journal.store({UID_B: ENTRIES[UID_B]})
    journal.store(ENTRIES)
    journal.store({UID_A: ENTRIES[UID_A]})
    log = data_dir / "checkpoint.log"
    log.write_bytes(log.read_bytes().replace(b"claim-a", b"claim-x", 1))
    code, report, err = show(data_dir)
    assert code == 1 and report["status"] == "corrupt" and "line 1:" in report["problem"]
    assert report["problemPath"] == str(log)
    assert {e["name"] for e in report["entries"]} == {"claim-x"}  # as stored, replayed
    code, out, err = quarantine(data_dir, "--yes")
    assert (code, err) == (0, "")
    assert "checkpoint.log to checkpoint.log.corrupt-" in out
    assert not log.exists() and len(list(data_dir.glob("checkpoint.log.corrupt-*"))) == 1
    assert Checkpoint(data_dir).load() == {}


def test_host_root_finds_the_nodes_directories_through_its_symlinks(tmp_path: Path) -> None:
    """A `kubectl debug node` container sees the node's / at /host, where /var/run is a
    symlink to /run: `/host/var/run/cdi` would resolve inside the container (its own,
    empty /run). --host-root follows the node's links within the host root."""
    host = tmp_path / "host"
    state = host / "var/lib/kubelet/plugins" / DRIVER
    state.mkdir(parents=True)
    Checkpoint(state).store(ENTRIES)
    (host / "run/cdi").mkdir(parents=True)
    (host / "var/run").symlink_to("/run")  # as on the node: absolute
    CdiSpecs(host / "run/cdi", DRIVER).claim_spec_path(UID_A).write_text("{}")

    code, out, err = gpu_dra(["journal", "show", "--host-root", str(host), "-o", "json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["path"].startswith(str(state))
    assert report["cdiRoot"] == str(host / "run/cdi")
    entries = {e["uid"]: e for e in report["entries"]}
    assert entries[UID_A]["cdiSpecPresent"] is True


def test_node_path_never_leaves_the_host_root(tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "a").mkdir(parents=True)
    (host / "a/up").symlink_to("../../../../etc")
    (host / "loop").symlink_to("/loop")
    assert node_path(str(host), Path("/a/up/passwd")) == host / "etc/passwd"
    assert node_path(None, Path("/var/run/cdi")) == Path("/var/run/cdi")
    with pytest.raises(ValueError, match="symbolic links"):
        node_path(str(host), Path("/loop/x"))
