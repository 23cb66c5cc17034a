"""A legitimate client's answer rate and latency under the floods of issue 34 (items 2
and 3), against the real servers of a source tree:

    python -m bench.http_floods [--tree LABEL=DIR ...] [--rounds N] [--seconds S] [--out FILE]

Each `--tree` is a checkout whose `driver` package the servers run (default: this one,
labelled `this`), so the code before a change is measured by the same harness, e.g.
`git archive <commit> driver | tar -x -C /tmp/before` and `--tree before=/tmp/before
--tree after=.`; the trees take turns, scenario by scenario, `--rounds` times. The
floods (`bench.http_attackers`) run in a process of their own from 127.0.0.1; the
legitimate client measures from
127.0.0.2, one request at a time on a fresh connection, as the API server sends a
review (timeout 10 s, its default `timeoutSeconds`) and the kubelet a liveness probe
(timeout 5 s, the chart's). Each scenario first measures without the flood (the
baseline), then for `--seconds` under it; the server's peak RSS is its VmHWM.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# One client context, made once as the API server keeps its own (loading the system's CA
# store for every review would time the client's CPU, not the webhook).
from bench.http_attackers import CLIENT_CONTEXT, post, read_answer, review_body

REPO = Path(__file__).resolve().parents[1]
LEGIT = "127.0.0.2"
REVIEW_TIMEOUT = 10.0
PROBE_TIMEOUT = 5.0
PAUSE = 0.2  # between two legitimate requests
BASELINE_REQUESTS = 10
WARM_UP = 5.0  # seconds of flood before the measurement

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


@dataclass
class Outcome:
    tree: str
    scenario: str
    baseline_p50_ms: float
    answered: int
    sent: int
    p50_ms: float | None
    p90_ms: float | None
    max_ms: float | None
    server_peak_rss_mib: float


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def _webhook(tree: Path, workdir: Path) -> tuple[subprocess.Popen[str], int]:
    cert, key = workdir / "tls.crt", workdir / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "driver.webhook.main", "--tls-cert-file", str(cert),
         "--tls-private-key-file", str(key), "--port", "0", "--bind-address", "127.0.0.1"],
        stderr=subprocess.PIPE, text=True, env=_env(tree), cwd=workdir,
    )  # fmt: skip
    return process, _port(process, r"serving https on port (\d+)", process.stderr)


def _plugin_http(tree: Path, workdir: Path) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-c", PLUGIN_HTTP],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=_env(tree), cwd=workdir,
    )  # fmt: skip
    return process, _port(process, r"^port (\d+)", process.stdout)


def _port(process: subprocess.Popen[str], pattern: str, stream: object) -> int:
    assert hasattr(stream, "readline")
    for _ in range(100):
        found = re.search(pattern, stream.readline())
        if found:
            return int(found.group(1))
    process.kill()
    raise SystemExit("the server did not start")


def _connect(port: int, timeout: float) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(LEGIT, 0))


def legit_review(port: int) -> bool:
    try:
        with CLIENT_CONTEXT.wrap_socket(
            _connect(port, REVIEW_TIMEOUT), server_hostname="x"
        ) as sock:
            sock.sendall(post(review_body("legit")))
            return read_answer(sock)
    except OSError:
        return False


def healthz_probe(port: int) -> bool:
    try:
        with _connect(port, PROBE_TIMEOUT) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(PROBE_TIMEOUT)
            return sock.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def _measure(ask: Callable[[], bool], until: float | None, count: int = 0) -> list[float | None]:
    """Latencies in seconds, None for a request without an answer."""
    results: list[float | None] = []
    while (until is not None and time.monotonic() < until) or len(results) < count:
        began = time.monotonic()
        results.append(time.monotonic() - began if ask() else None)
        time.sleep(PAUSE)
    return results


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(found.group(1)) / 1024 if found else 0.0


def _ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(1000 * statistics.quantiles(values, n=10, method="inclusive")[int(q * 10) - 1]
                 if q < 1 else 1000 * max(values), 1)  # fmt: skip


def scenario(name: str, flood: str, label: str, tree: Path, seconds: float) -> Outcome:
    with tempfile.TemporaryDirectory() as tmp:
        is_webhook = flood != "status-metrics"
        process, port = (_webhook if is_webhook else _plugin_http)(tree, Path(tmp))
        ask = (lambda: legit_review(port)) if is_webhook else (lambda: healthz_probe(port))
        try:
            baseline = [t for t in _measure(ask, None, BASELINE_REQUESTS) if t is not None]
            flood_seconds = str(seconds + WARM_UP)
            attackers = subprocess.Popen(
                [sys.executable, "-m", "bench.http_attackers", flood, str(port), flood_seconds],
                cwd=REPO, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(WARM_UP)  # the flood builds up
            under = _measure(ask, time.monotonic() + seconds)
            attackers.wait(60)
            peak = _peak_rss_mib(process.pid)
        finally:
            process.kill()
            process.wait(10)
    answered = [t for t in under if t is not None]
    return Outcome(
        label, name, _ms(baseline, 0.5) or 0.0, len(answered), len(under),
        _ms(answered, 0.5), _ms(answered, 0.9), _ms(answered, 1.0), round(peak, 1),
    )  # fmt: skip


SCENARIOS = (
    ("review under unread 9 MB answers (item 2)", "unread-answers"),
    ("review under busy keep-alive reviews (item 3)", "busy-reviews"),
    ("/healthz under /status + /metrics clients (item 3)", "status-metrics"),
)


def _tree(text: str) -> tuple[str, Path]:
    label, _, path = text.rpartition("=")
    return label or path, Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.http_floods", description=__doc__)
    parser.add_argument("--tree", type=_tree, action="append", metavar="LABEL=DIR")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = args.tree or [("this", REPO)]
    outcomes = []
    for _ in range(args.rounds):
        for name, flood in SCENARIOS:
            for label, path in trees:
                o = scenario(name, flood, label, path, args.seconds)
                outcomes.append(o)
                print(
                    f"{o.tree}: {o.scenario}: answered {o.answered}/{o.sent}, p50/p90/max "
                    f"{o.p50_ms}/{o.p90_ms}/{o.max_ms} ms (baseline p50 {o.baseline_p50_ms} "
                    f"ms), server peak RSS {o.server_peak_rss_mib} MiB",
                    flush=True,
                )
    if args.out:
        document = {
            "command": "python -m bench.http_floods " + " ".join(sys.argv[1:]),
            "trees": {label: str(path) for label, path in trees},
            "seconds": args.seconds,
            "outcomes": [asdict(o) for o in outcomes],
        }
        args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
