"""Run a command in a runc container started with exactly a claim's CDI edits.

What a CDI-enabled runtime does with `k8s.<driver>/gpu=<device>` ids, done by hand for
tests that have runc but no containerd: the spec-wide edits of every spec that names a
device, then each device's edits, applied to `runc spec`'s default config (env,
device nodes with their cgroup rules, bind mounts, OCI hooks). The root filesystem is
the caller's (a static busybox, the host's C library for a real nvidia-smi, the host's
Python for a CUDA client: tests/gpu/rootfs.py). `run` waits for the command; `started`
leaves it running, its stdin and stdout the caller's to talk through.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

RUNC = (
    Path(os.environ.get("GPU_DRA_CACHE", Path.home() / ".cache/gpu-dra-driver"))
    / "bin/containerd-2.3.7-runc-1.5.2/runc"
)


def _device(node: Mapping[str, Any]) -> dict[str, Any]:
    if node.get("major") is None:  # path-only: the runtime reads the host's node
        st = os.stat(node.get("hostPath") or node["path"])
        node = {**node, "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)}
        node.setdefault("type", "c" if stat.S_ISCHR(st.st_mode) else "b")
    return {
        "path": node["path"],
        "type": node.get("type", "c"),
        "major": node["major"],
        "minor": node.get("minor", 0),
        "fileMode": node.get("fileMode", 0o666),
        "uid": 0,
        "gid": 0,
    }


def apply_edits(config: dict[str, Any], edits: Mapping[str, Any]) -> None:
    """One CDI containerEdits onto an OCI config, as the CDI library applies them."""
    process = config["process"]
    process["env"] = [*process.get("env", []), *edits.get("env", [])]
    linux = config.setdefault("linux", {})
    for node in edits.get("deviceNodes", []):
        device = _device(node)
        linux.setdefault("devices", []).append(device)
        allow = {"allow": True, "type": device["type"], "access": "rwm"}
        allow |= {"major": device["major"], "minor": device["minor"]}
        linux.setdefault("resources", {}).setdefault("devices", []).append(allow)
    for mount in edits.get("mounts", []):
        config["mounts"].append(
            {
                "destination": mount["containerPath"],
                "source": mount["hostPath"],
                "type": mount.get("type", "bind"),
                "options": mount.get("options", ["rbind", "ro"]),
            }
        )
    for hook in edits.get("hooks", []):
        entry = {"path": hook["path"], "args": hook.get("args", []), "env": hook.get("env", [])}
        config.setdefault("hooks", {}).setdefault(hook["hookName"], []).append(entry)


def edits_for(specs: Iterable[Mapping[str, Any]], devices: Sequence[str]) -> list[dict[str, Any]]:
    """The edits a runtime applies for fully qualified ids `kind=name`, in order."""
    wanted = {tuple(d.split("=", 1)) for d in devices}
    out: list[dict[str, Any]] = []
    for spec in specs:
        names = [d["name"] for d in spec["devices"] if (spec["kind"], d["name"]) in wanted]
        if not names:
            continue
        out.append(spec.get("containerEdits") or {})
        out += [d["containerEdits"] for d in spec["devices"] if d["name"] in names]
    found = sum(1 for s in specs for d in s["devices"] if (s["kind"], d["name"]) in wanted)
    assert found == len(wanted), f"unresolvable CDI devices among {devices}"
    return out


def write_config(
    bundle: Path,
    rootfs: Path,
    specs: Iterable[Mapping[str, Any]],
    devices: Sequence[str],
    args: Sequence[str],
) -> None:
    """`bundle/config.json`: `runc spec`'s default with the devices' edits applied."""
    assert RUNC.is_file(), f"{RUNC} missing: make cluster-build builds runc"
    bundle.mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").unlink(missing_ok=True)
    subprocess.run([str(RUNC), "spec", "--bundle", str(bundle)], check=True)
    config = json.loads((bundle / "config.json").read_text())
    config["root"] = {"path": str(rootfs), "readonly": False}  # hooks write links, ld cache
    config["process"].update(terminal=False, args=list(args))
    config["process"]["env"] = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    for edits in edits_for(list(specs), devices):
        apply_edits(config, edits)
    (bundle / "config.json").write_text(json.dumps(config))


def _run_argv(bundle: Path, name: str) -> list[str]:
    return [str(RUNC), "--root", str(bundle / "runc-state"), "run", "--bundle", str(bundle), name]


def _delete(bundle: Path, name: str) -> None:
    subprocess.run(
        [str(RUNC), "--root", str(bundle / "runc-state"), "delete", "--force", name],
        capture_output=True,
        check=False,
    )


def run(
    bundle: Path,
    rootfs: Path,
    specs: Iterable[Mapping[str, Any]],
    devices: Sequence[str],
    args: Sequence[str],
) -> subprocess.CompletedProcess[str]:
    """`runc run` of `args` in a container with the devices' edits; its output."""
    write_config(bundle, rootfs, specs, devices, args)
    name = f"gpu-dra-test-{uuid.uuid4().hex[:8]}"
    try:
        return subprocess.run(
            _run_argv(bundle, name), capture_output=True, text=True, timeout=120, check=False
        )
    finally:
        _delete(bundle, name)


@contextlib.contextmanager
def started(
    bundle: Path,
    rootfs: Path,
    specs: Iterable[Mapping[str, Any]],
    devices: Sequence[str],
    args: Sequence[str],
) -> Iterator[subprocess.Popen[str]]:
    """`runc run` of `args` in a container with the devices' edits, in the foreground
    without a terminal: the container's process reads the returned process's stdin and
    writes its stdout, runc's and its stderr merged into it (pipes, text). On leaving,
    the container is deleted (killed if it still runs)."""
    write_config(bundle, rootfs, specs, devices, args)
    name = f"gpu-dra-test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        _run_argv(bundle, name),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield proc
    finally:
        _delete(bundle, name)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
