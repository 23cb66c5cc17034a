"""What a benchmark run measured on: the machine and its disk's floor, and what each Go
binary under test was built from (as `go version -m` reads it from the binary)."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.cluster import BenchError
from bench.plugins import NVML_LIBRARY
from bench.scenarios import summary


def machine(path: Path) -> dict[str, Any]:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    fs = subprocess.run(
        ["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "-T", str(path)], capture_output=True, text=True
    ).stdout.strip()
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "bench_dir_filesystem": fs,
        "bench_dir": str(path),
    }


def parse_go_build_info(binary: str, text: str) -> dict[str, Any]:
    """The Go version, main package, main module and version, and (for a build from a
    checkout) the VCS revision and whether the tree was modified, from the output of
    `go version -m binary`."""
    info: dict[str, Any] = {}
    for line in text.splitlines():
        fields = line.split()
        if line.startswith(f"{binary}:"):
            info["go"] = fields[-1]
        elif fields[:1] == ["path"]:
            info["package"] = fields[1]
        elif fields[:1] == ["mod"]:
            info["module"], info["version"] = fields[1], fields[2]
        elif fields[:1] == ["build"] and fields[1].startswith("vcs.revision="):
            info["vcs_revision"] = fields[1].split("=", 1)[1]
        elif fields[:1] == ["build"] and fields[1].startswith("vcs.modified="):
            info["vcs_modified"] = fields[1].split("=", 1)[1] == "true"
    return info


def go_build_info(binary: str) -> dict[str, Any]:
    out = subprocess.run(["go", "version", "-m", binary], capture_output=True, text=True)
    if out.returncode != 0:
        raise BenchError(f"go version -m {binary}: {out.stderr.strip()}")
    return parse_go_build_info(binary, out.stdout)


def reference_build(binary: str) -> dict[str, Any]:
    """What the reference binary was built from, as its Go build info says."""
    info: dict[str, Any] = {"binary": binary, "built_by": "hack/build-reference.sh"}
    info.update(go_build_info(binary))
    if "version" not in info:
        raise BenchError(f"go version -m {binary} names no module version")
    return info


def nvidia_build(binary: str, nvml_dir: str) -> dict[str, Any]:
    """What NVIDIA's plugin and the mock NVML it runs over were built from: both are
    built from checkouts (docs/benchmarks.md), so their build info names the commit."""
    library = str((Path(nvml_dir) / NVML_LIBRARY).resolve())
    return {
        "binary": binary,
        "plugin": go_build_info(binary),
        "nvml_library": library,
        "nvml": go_build_info(library),
    }


def fsync_floor(directory: Path, n: int = 200) -> dict[str, Any]:
    """The disk's floor for the prepare path: fsync of a small file, and one complete
    atomic write (temp file, write, fsync, rename, directory fsync)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "bench-fsync.json"
    payload = b'{"bench": "' + b"x" * 200 + b'"}\n'
    fsyncs: list[float] = []
    atomic: list[float] = []
    for _ in range(n):
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, payload)
        t = time.perf_counter()
        os.fsync(fd)
        fsyncs.append(time.perf_counter() - t)
        os.close(fd)
    tmp = directory / ".bench-fsync.tmp"
    for _ in range(n):
        t = time.perf_counter()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, payload)
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, target)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
        atomic.append(time.perf_counter() - t)
    target.unlink(missing_ok=True)
    return {"fsync": summary(fsyncs), "atomic_write": summary(atomic)}
