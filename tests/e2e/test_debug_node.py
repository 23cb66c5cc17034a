"""`kubectl debug node`, as docs/day-2.md writes it, reaches the plugin's root-only
state directory: the image runs as uid 65532, so the debug container needs
`--profile=sysadmin` and a custom spec setting `runAsUser: 0`; without it the journal
cannot be read. Runs the documented `gpu-dra journal show --host-root /host` (read only,
safe while the plugin runs), taken from docs/day-2.md as written, on the local node
through a real kubelet and containerd, where /var/run is a link to /run: the CDI specs
are checked."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from tests.conftest import wait_for
from tests.e2e.conftest import DRIVER, E2E, REPO

STATE_DIR = f"/host/var/lib/kubelet/plugins/{DRIVER}"
ROOT = "securityContext:\n  runAsUser: 0\n  runAsGroup: 0\n"
DAY_2 = REPO / "docs" / "day-2.md"


def documented_command() -> list[str]:
    """The command docs/day-2.md runs in the node debug container ("On the node")."""
    text = DAY_2.read_text()
    start = text.index("kubectl debug node/<node>")
    block = text[start : text.index("```", start)].replace("\\\n", " ")
    return shlex.split(block.split(" -- ", 1)[1])


def _debug_journal_show(e2e: E2E, *flags: str, command: list[str] | None = None) -> tuple[str, str]:
    """Run `command` (default: `gpu-dra journal show` of the state dir as JSON) in a
    node debug pod: (its final phase, its log)."""
    plugin = e2e.plugin_pod()
    image = next(c["image"] for c in plugin["spec"]["containers"] if c["name"] == "plugin")
    proc = e2e.kubectl(
        "debug",
        f"node/{plugin['spec']['nodeName']}",
        *flags,
        f"--image={image}",
        "--image-pull-policy=Never",
        "--",
        *(command or ["gpu-dra", "journal", "show", "--state-dir", STATE_DIR, "-o", "json"]),
    )
    found = re.search(r"debugging pod (\S+)", proc.stdout + proc.stderr)
    assert found, proc.stdout + proc.stderr
    pod = found.group(1)
    try:

        def finished() -> str | None:
            phase: str = e2e.get("pod", pod)["status"].get("phase", "")
            return phase if phase in ("Succeeded", "Failed") else None

        phase = wait_for(finished, timeout=120, what=f"debug pod {pod} to finish")
        return phase, e2e.kubectl("logs", pod).stdout
    finally:
        e2e.kubectl("delete", "pod", pod, "--wait=false", check=False)


def test_the_documented_command_reads_the_journal_as_root(e2e: E2E, tmp_path: Path) -> None:
    custom = tmp_path / "root.yaml"
    custom.write_text(ROOT)
    phase, log = _debug_journal_show(e2e, "--profile=sysadmin", f"--custom={custom}")
    assert phase == "Succeeded", log
    report: dict[str, Any] = json.loads(log)
    assert report["status"] in ("ok", "absent") and report["path"].startswith(STATE_DIR)


def test_the_documented_command_as_written_checks_the_cdi_specs(e2e: E2E, tmp_path: Path) -> None:
    command = documented_command()
    assert command[:3] == ["gpu-dra", "journal", "show"] and "--host-root" in command
    custom = tmp_path / "root.yaml"
    custom.write_text(ROOT)
    phase, log = _debug_journal_show(
        e2e, "--profile=sysadmin", f"--custom={custom}", command=command
    )
    print(f"\n$ {shlex.join(command)}\n{log}")
    assert phase == "Succeeded", log
    assert f"journal {STATE_DIR}/checkpoint.json" in log, log
    assert "CDI specs not checked" not in log, log


def test_without_root_the_state_directory_is_out_of_reach(e2e: E2E) -> None:
    phase, log = _debug_journal_show(e2e, "--profile=sysadmin")
    assert phase == "Failed", log
    # One line naming the directory and what to do, not a traceback.
    assert f"permission denied on {STATE_DIR}: run as root" in log, log
    assert "Traceback" not in log, log
