"""The servers `bench.http_floods` measures, each a process of its own on 127.0.0.1 port
0: a source tree's real webhook (`driver.webhook.main`) and plugin HTTP port
(`driver.observability.http`), or a candidate library's webhook
(`bench.http_candidates`, run with PYTHONPATH=<repo>:<candidates dir>)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.http_candidates import CANDIDATES, LIBRARIES

REPO = Path(__file__).resolve().parents[1]
CANDIDATES_DIR = Path.home() / ".cache/gpu-dra-driver/bench-candidates"

PLUGIN_HTTP = """
import sys, time
from driver.observability.http import HttpServer
server = HttpServer(0, lambda: (True, "ok\\n"), "127.0.0.1")
gpus = [{"index": i, "uuid": f"GPU-{i:08x}", "pci": f"0000:{i:02x}:00.0", "devices": [
    {"name": f"gpu-{i}-mig-1g10gb-{p}", "profile": "1g.10gb", "placement": p} for p in range(7)]}
    for i in range(8)]
if hasattr(server, "serve_status"):  # trees before /status moved to the status socket
    server.serve_status(lambda: {"node": "n", "gpus": gpus, "prepared": 3})
server.start()
print("port", server.port, flush=True)
time.sleep(3600)
"""


@dataclass(frozen=True)
class Server:
    """A source tree (`kind` "tree", `where` its directory) or a candidate library
    (`kind` "candidate", `where` the directory its libraries are installed in)."""

    label: str
    kind: str
    where: Path

    def describe(self) -> str:
        if self.kind == "tree":
            return str(self.where)
        return ", ".join(f"{n} {_version(n, self.where)}" for n in LIBRARIES[self.label])


def _version(name: str, where: Path) -> str:
    for found in importlib.metadata.distributions(name=name, path=[str(where), *sys.path]):
        return str(found.version)
    return "?"


def check_candidates(where: Path) -> None:
    if not (where / ".installed").is_file():
        raise SystemExit(f"no candidate libraries in {where}: run bench/candidates-install.sh")


def _tls_files(workdir: Path) -> tuple[Path, Path]:
    cert, key = workdir / "tls.crt", workdir / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def start_webhook(server: Server, workdir: Path) -> tuple[subprocess.Popen[str], int]:
    cert, key = _tls_files(workdir)
    tls = ["--tls-cert-file", str(cert), "--tls-private-key-file", str(key)]
    if server.kind == "tree":
        process = subprocess.Popen(
            [sys.executable, "-m", "driver.webhook.main", *tls, "--port", "0",
             "--bind-address", "127.0.0.1"],
            stderr=subprocess.PIPE, text=True, env=_env(server.where), cwd=workdir,
        )  # fmt: skip
        return process, _port(process, r"serving https on port (\d+)", process.stderr)
    errors = (workdir / "server.err").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", f"bench.http_candidates.{CANDIDATES[server.label]}", *tls],
        stdout=subprocess.PIPE, stderr=errors, text=True, cwd=workdir,
        env=_env(REPO, server.where),
    )  # fmt: skip
    return process, _port(process, r"^port (\d+)", process.stdout, workdir / "server.err")


def start_plugin_http(tree: Path, workdir: Path) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-c", PLUGIN_HTTP],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(tree), cwd=workdir,
    )  # fmt: skip
    return process, _port(process, r"^port (\d+)", process.stdout)


def _env(*path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}


def _port(
    process: subprocess.Popen[str], pattern: str, stream: object, errors: Path | None = None
) -> int:
    assert hasattr(stream, "readline")
    for _ in range(100):
        found = re.search(pattern, stream.readline())
        if found:
            return int(found.group(1))
    process.kill()
    tail = errors.read_text()[-2000:] if errors else ""
    raise SystemExit(f"the server did not start\n{tail}")


def peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) / 1024 if found else 0.0
