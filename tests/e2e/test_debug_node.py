"""`kubectl debug node`, as docs/day-2.md writes it, reaches the plugin's root-only
state directory: the image runs as uid 65532, so the debug container needs
`--profile=sysadmin` and a custom spec setting `runAsUser: 0`; without it the journal
cannot be read. Runs `gpu-dra journal show` (read only, safe while the plugin runs)
on the local node through a real kubelet and containerd."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.conftest import wait_for
from tests.e2e.conftest import DRIVER, E2E

STATE_DIR = f"/host/var/lib/kubelet/plugins/{DRIVER}"
ROOT = "securityContext:\n  runAsUser: 0\n  runAsGroup: 0\n"


def _debug_journal_show(e2e: E2E, *flags: str) -> tuple[str, str]:
    """Run `gpu-dra journal show` in a node debug pod: (its final phase, its log)."""
    plugin = e2e.plugin_pod()
    image = next(c["image"] for c in plugin["spec"]["containers"] if c["name"] == "plugin")
    proc = e2e.kubectl(
        "debug",
        f"node/{plugin['spec']['nodeName']}",
        *flags,
        f"--image={image}",
        "--image-pull-policy=Never",
        "--",
        *("gpu-dra", "journal", "show", "--state-dir", STATE_DIR, "-o", "json"),
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


def test_without_root_the_state_directory_is_out_of_reach(e2e: E2E) -> None:
    phase, log = _debug_journal_show(e2e, "--profile=sysadmin")
    assert phase == "Failed", log
    # One line naming the directory and what to do, not a traceback.
    assert f"permission denied on {STATE_DIR}: run as root" in log, log
    assert "Traceback" not in log, log
