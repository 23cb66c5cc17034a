"""The GPU settings a run of the real-GPU tier may change, saved before it and put back
after it (hack/gpu-tier-mps.sh): each GPU's compute mode and time-slice interval.
MIG mode is only read: the tier never changes it, and `restore` says so if it did
change (it is never set back here either).

    python -m tests.gpu.tier_settings save FILE     # nvidia-smi's view, as JSON
    python -m tests.gpu.tier_settings restore FILE  # set back what differs; one line each

nvidia-smi is the driver root's (`NVIDIA_DRIVER_ROOT`, default /), as the driver runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from driver.nvml.smi_timeslice import NvidiaSmiTimeSlice

# nvidia-smi's compute-mode names as it lists them -> as `-c` takes them.
COMPUTE_MODES = {
    "Default": "DEFAULT",
    "Exclusive_Process": "EXCLUSIVE_PROCESS",
    "Prohibited": "PROHIBITED",
}


def _smi() -> NvidiaSmiTimeSlice:
    return NvidiaSmiTimeSlice(Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/"))


def _run(*args: str) -> str:
    argv = [str(_smi().binary()), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout


def read() -> dict[str, dict[str, str]]:
    """GPU UUID -> compute mode, MIG mode and time-slice interval as nvidia-smi lists
    them (`?` where it lists none)."""
    query = "--query-gpu=uuid,compute_mode,mig.mode.current"
    found: dict[str, dict[str, str]] = {}
    for line in _run(query, "--format=csv,noheader").splitlines():
        if not line.strip():
            continue
        uuid, compute, mig = (part.strip() for part in line.split(","))
        listed = _run("compute-policy", "-l", "-i", uuid)
        interval = re.search(r"\bTimeslice\s+(\w+)", listed)
        found[uuid] = {
            "compute_mode": compute,
            "mig_mode": mig,
            "timeslice": interval.group(1) if interval else "?",
        }
    return found


def restore(saved: dict[str, dict[str, str]]) -> list[str]:
    """Set back each compute mode and time-slice interval that differs from `saved`;
    one line per GPU and setting (what was done, or that MIG mode changed)."""
    lines = []
    now = read()
    for uuid, before in saved.items():
        after = now.get(uuid)
        if after is None:
            lines.append(f"{uuid}: no longer listed by nvidia-smi")
            continue
        if after["mig_mode"] != before["mig_mode"]:
            lines.append(f"{uuid}: MIG mode changed {before['mig_mode']} -> {after['mig_mode']}")
        if after["compute_mode"] != before["compute_mode"]:
            wanted = COMPUTE_MODES.get(before["compute_mode"], before["compute_mode"])
            _run("-i", uuid, "-c", wanted)
            lines.append(f"{uuid}: compute mode {after['compute_mode']} set back to {wanted}")
        if after["timeslice"] != before["timeslice"] and before["timeslice"] != "?":
            _smi().set(uuid, before["timeslice"])
            was, now_set = after["timeslice"], before["timeslice"]
            lines.append(f"{uuid}: time slice {was} set back to {now_set}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("save", "restore"):
        print("usage: python -m tests.gpu.tier_settings save|restore FILE", file=sys.stderr)
        return 2
    path = Path(argv[1])
    if argv[0] == "save":
        settings = read()
        path.write_text(json.dumps(settings, indent=1) + "\n")
        for uuid, values in settings.items():
            print(f"{uuid}: " + ", ".join(f"{k} {v}" for k, v in sorted(values.items())))
        return 0
    lines = restore(json.loads(path.read_text()))
    for line in lines:
        print(line)
    if not lines:
        print("every GPU setting as it was before the run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
