"""What the container tests of the real-GPU tier build on the host: the driver's CDI
tools, where a claim's specs mount a driver binary, and root filesystems that hold
nothing of NVIDIA's (the claim's CDI edits must bring the driver): the C library of a
program (tests/gpu/test_cdi_container.py), or this host's Python with its standard
library for a CUDA client written in Python (tests/gpu/test_mps_containers.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")
SCRIPT_DIR = "/opt"
NVIDIA_LIBRARIES = ("libnvidia", "libcuda")
# Not needed to run a script with -S, and large (config-*: the static libpython).
_STDLIB_LEFT_OUT = (
    "__pycache__", "site-packages", "dist-packages", "test", "idlelib", "tkinter", "ensurepip",
    "config-*",
)  # fmt: skip


def cdi_tools() -> Path:
    """The directory of gpu-dra-cdi-common and nvidia-cdi-hook
    (hack/build-nvidia-tools.sh); fails the test, saying so, without them."""
    proc = subprocess.run(
        ["bash", str(REPO / "hack/build-nvidia-tools.sh"), "path"],
        capture_output=True,
        text=True,
        check=False,
    )
    tools = Path(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else Path()
    missing = [n for n in ("gpu-dra-cdi-common", "nvidia-cdi-hook") if not (tools / n).is_file()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing in {tools}: run hack/build-nvidia-tools.sh")
    return tools


def mounted_binary(specs: list[dict[str, Any]], name: str) -> tuple[Path, str]:
    """Where the specs mount the driver's binary `name`: its host path and the path the
    container sees (a driver root such as /usr/local/nvidia keeps its own layout)."""
    for spec in specs:
        edits = [spec.get("containerEdits", {})]
        edits += [device["containerEdits"] for device in spec.get("devices", [])]
        for mount in (m for e in edits for m in e.get("mounts", [])):
            if Path(mount["containerPath"]).name == name:
                return Path(mount["hostPath"]), mount["containerPath"]
    pytest.fail(f"the claim's CDI specs mount no {name}")


def driver_libraries(specs: list[dict[str, Any]]) -> list[Path]:
    """The host paths of the driver's libraries the specs mount (libcuda and
    libnvidia-*): a program that loads them needs the C libraries they link."""
    found = set()
    for spec in specs:
        edits = [spec.get("containerEdits", {})]
        edits += [device["containerEdits"] for device in spec.get("devices", [])]
        for mount in (m for e in edits for m in e.get("mounts", [])):
            name = Path(mount["containerPath"]).name
            if name.startswith(NVIDIA_LIBRARIES) and ".so" in name:
                found.add(Path(mount["hostPath"]))
    return sorted(found)


def c_library_rootfs(rootfs: Path, program: Path, modules: Sequence[Path] = ()) -> None:
    """The loader and C libraries `program` links, and those its loadable `modules`
    link where ldd can tell, none of NVIDIA's, in /lib."""
    out = subprocess.run(["ldd", str(program)], capture_output=True, text=True, check=True)
    listed = out.stdout
    if modules:
        more = subprocess.run(
            ["ldd", *map(str, modules)], capture_output=True, text=True, check=False
        )
        listed += more.stdout
    (rootfs / "lib").mkdir(parents=True)
    (rootfs / "lib64").symlink_to("lib")
    for d in ("etc", "usr/bin", "usr/lib/x86_64-linux-gnu", "dev", "proc", "sys", "tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for match in LDD_LINE.finditer(listed):
        library = Path(match.group(1))
        target = rootfs / "lib" / library.name
        if not library.name.startswith(NVIDIA_LIBRARIES) and not target.exists():
            shutil.copy2(library.resolve(), target)


def _inside(rootfs: Path, host_path: Path) -> Path:
    return rootfs / host_path.relative_to("/")


def python_rootfs(rootfs: Path, script: Path, loaded: Sequence[Path] = ()) -> list[str]:
    """A root filesystem with the Python running these tests, at its host path, with
    its standard library and extension modules and the C libraries they link (none of
    NVIDIA's; of the extension modules' libraries only ctypes' libffi), and those
    linked by the libraries the script will load (`loaded`: e.g. the driver's, which
    the CDI edits mount; libcuda links libdl, libpthread, librt), and `script` in
    /opt; the argv that runs the script there: -S (no site packages: the script needs
    the standard library only), -u (its lines go out at once)."""
    interpreter = Path(os.path.realpath(sys.executable))
    stdlib = Path(sysconfig.get_path("stdlib"))
    extensions = next(Path(p) for p in sys.path if p.endswith("lib-dynload"))
    c_library_rootfs(rootfs, interpreter, [*extensions.glob("_ctypes*.so"), *loaded])
    _inside(rootfs, interpreter).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(interpreter, _inside(rootfs, interpreter))
    left_out = shutil.ignore_patterns(*_STDLIB_LEFT_OUT)
    shutil.copytree(stdlib, _inside(rootfs, stdlib), symlinks=True, ignore=left_out)
    if not _inside(rootfs, extensions).exists():
        shutil.copytree(extensions, _inside(rootfs, extensions), symlinks=True)
    (rootfs / SCRIPT_DIR.lstrip("/")).mkdir(parents=True, exist_ok=True)
    shutil.copy2(script, rootfs / SCRIPT_DIR.lstrip("/") / script.name)
    return [str(interpreter), "-S", "-u", f"{SCRIPT_DIR}/{script.name}"]
