"""A legitimate client's answer rate and latency under hostile clients (the floods of
issue 34, the slow and malformed clients of security rounds three and five and of issue
42), against the real servers of source trees and against candidate libraries:

    python -m bench.http_floods [--tree LABEL=DIR ...] [--candidate NAME ...]
        [--scenario FLOOD ...] [--rounds N] [--seconds S] [--out FILE]

Each `--tree` is a checkout whose `driver` package the servers run (default, when
neither --tree nor --candidate is given: this one, labelled `this`), so the code before
a change is measured by the same harness, e.g. `git archive <commit> driver | tar -x -C
/tmp/before` and `--tree before=/tmp/before --tree after=.`. Each `--candidate` is a
webhook built on an HTTP server library (`bench.http_candidates`: uvicorn-httptools,
uvicorn-h11, hypercorn-h11, aiohttp; `bench/candidates-install.sh` installs them); it
serves the webhook only, so the plugin-port scenario skips it. The servers take turns,
scenario by scenario, `--rounds` times; `--scenario` (a flood's name, repeatable) runs
only those. `python -m bench.http_report --in FILE` prints the table of a results file.

The floods (`bench.http_attackers`, `bench.http_hostile`) run in a process of their
own from 127.0.0.1 (`per-address-cap` from 127.0.0.2); the legitimate client measures
from 127.0.0.2, one request at a time on a fresh connection, as the API server sends a
review: a review counts as answered when its 200 arrives within 10 s (the API server's
default `timeoutSeconds`). Beside it, on the webhook, a probe GETs /readyz over TLS
from 127.0.0.3 as the kubelet does (1 s, its default `timeoutSeconds`: the chart sets
none); on the plugin's port the measured request is the /healthz probe (5 s, the
chart's). Each scenario first measures without the flood (the baseline), then for
`--seconds` under it, then 3 reviews once the flood has ended; the server's peak RSS is
its VmHWM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from subprocess import Popen

from bench.http_candidates import CANDIDATES
from bench.http_legit import (
    PROBE_TIMEOUT,
    REVIEW_TIMEOUT,
    WEBHOOK_PROBE_TIMEOUT,
    healthz_probe,
    legit_review,
    webhook_probe,
)
from bench.http_servers import (
    CANDIDATES_DIR,
    REPO,
    Server,
    check_candidates,
    peak_rss_mib,
    start_plugin_http,
    start_webhook,
)

PAUSE = 0.2  # between two legitimate requests
PROBE_PAUSE = 0.5  # between two probes of the webhook
BASELINE_REQUESTS = 10
AFTER_REQUESTS = 3
WARM_UP = 5.0  # seconds of flood before the measurement
PLUGIN_FLOODS = frozenset({"status-metrics"})


@dataclass
class Outcome:
    tree: str  # the server's label: a tree's or a candidate's
    scenario: str
    baseline_p50_ms: float
    answered: int
    sent: int
    p50_ms: float | None
    p90_ms: float | None
    max_ms: float | None
    server_peak_rss_mib: float
    kind: str = "tree"
    flood: str = ""
    after_answered: int | None = None
    after_sent: int | None = None
    baseline_probe_p50_ms: float | None = None
    probes_answered: int | None = None
    probes_sent: int | None = None
    probe_p50_ms: float | None = None
    probe_p90_ms: float | None = None


Ask = tuple[Callable[[], bool], float]  # a request, and the time its answer may take


def _measure(
    ask: Ask, until: float | None, count: int = 0, pause: float = PAUSE
) -> list[float | None]:
    """Latencies in seconds, None for a request without an answer in time."""
    request, limit = ask
    results: list[float | None] = []
    while (until is not None and time.monotonic() < until) or len(results) < count:
        began = time.monotonic()
        ok = request()
        took = time.monotonic() - began
        results.append(took if ok and took <= limit else None)
        time.sleep(pause)
    return results


def _ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(1000 * statistics.quantiles(values, n=10, method="inclusive")[int(q * 10) - 1]
                 if q < 1 else 1000 * max(values), 1)  # fmt: skip


def _answered(results: list[float | None]) -> list[float]:
    return [t for t in results if t is not None]


def _start(flood: str, server: Server, workdir: Path) -> tuple[Popen[str], int, Ask, Ask | None]:
    """The server, its port, the measured request and the probe beside it (if any)."""
    if flood in PLUGIN_FLOODS:
        process, port = start_plugin_http(server.where, workdir)
        return process, port, ((lambda: healthz_probe(port)), PROBE_TIMEOUT), None
    process, port = start_webhook(server, workdir)
    probe = ((lambda: webhook_probe(port)), WEBHOOK_PROBE_TIMEOUT)
    return process, port, ((lambda: legit_review(port)), REVIEW_TIMEOUT), probe


def scenario(name: str, flood: str, server: Server, seconds: float) -> Outcome:
    probes: list[float | None] = []
    with tempfile.TemporaryDirectory() as tmp:
        process, port, ask, probe = _start(flood, server, Path(tmp))
        try:
            baseline = _answered(_measure(ask, None, BASELINE_REQUESTS))
            baseline_probes = _answered(_measure(probe, None, BASELINE_REQUESTS) if probe else [])
            attackers = Popen(
                [sys.executable, "-m", "bench.http_attackers", flood, str(port),
                 str(seconds + WARM_UP)], cwd=REPO, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(WARM_UP)  # the flood builds up
            until = time.monotonic() + seconds
            prober = threading.Thread(
                target=lambda: probes.extend(
                    _measure(probe, until, pause=PROBE_PAUSE) if probe else []
                )
            )
            prober.start()
            under = _measure(ask, until)
            prober.join()
            attackers.wait(60)
            after = _measure(ask, None, AFTER_REQUESTS)
            peak = peak_rss_mib(process.pid)
        finally:
            process.kill()
            process.wait(10)
    answered, probed = _answered(under), _answered(probes)
    return Outcome(
        server.label, name, _ms(baseline, 0.5) or 0.0, len(answered), len(under),
        _ms(answered, 0.5), _ms(answered, 0.9), _ms(answered, 1.0), round(peak, 1),
        server.kind, flood, len(_answered(after)), len(after), _ms(baseline_probes, 0.5),
        len(probed) if probe else None, len(probes) if probe else None,
        _ms(probed, 0.5), _ms(probed, 0.9),
    )  # fmt: skip


SCENARIOS = (
    ("review under unread 9 MB answers (item 2)", "unread-answers"),
    ("review under busy keep-alive reviews (item 3)", "busy-reviews"),
    ("/healthz under /status + /metrics clients (item 3)", "status-metrics"),
    ("review under 256 idle TCP connections (round three)", "idle-flood"),
    ("review under 128 slowloris heads (round three)", "slowloris"),
    ("review under 40 stalled 3 MiB uploads (round three)", "stalled-uploads"),
    ("review under a bare-LF head and 1-byte records (round five, H1)", "bare-lf-head"),
    ("review under 32 heads dribbled a byte per 10 ms", "one-byte-heads"),
    ("review under 32 bodies dribbled a byte per 10 ms", "dribbled-bodies"),
    ("review under 32 unfinished 8191-byte heads", "near-limit-heads"),
    ("review with 48 idle connections from its own address (L3)", "per-address-cap"),
)


def _line(o: Outcome) -> str:
    return (
        f"{o.tree}: {o.flood}: answered {o.answered}/{o.sent}, p50/p90/max {o.p50_ms}/"
        f"{o.p90_ms}/{o.max_ms} ms (baseline p50 {o.baseline_p50_ms} ms), after "
        f"{o.after_answered}/{o.after_sent}, probes {o.probes_answered}/{o.probes_sent} "
        f"p50/p90 {o.probe_p50_ms}/{o.probe_p90_ms} ms, peak RSS {o.server_peak_rss_mib} MiB"
    )


def _tree(text: str) -> tuple[str, Path]:
    label, _, path = text.rpartition("=")
    return label or path, Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.http_floods",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tree", type=_tree, action="append", default=[], metavar="LABEL=DIR")
    parser.add_argument("--candidate", action="append", default=[], choices=list(CANDIDATES))
    parser.add_argument("--candidates-dir", type=Path, default=CANDIDATES_DIR)
    flood_names = [flood for _, flood in SCENARIOS]
    parser.add_argument("--scenario", action="append", choices=flood_names, metavar="FLOOD")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    servers = [Server(label, "tree", path) for label, path in args.tree]
    servers += [Server(name, "candidate", args.candidates_dir) for name in args.candidate]
    if args.candidate:
        check_candidates(args.candidates_dir)
    servers = servers or [Server("this", "tree", REPO)]
    chosen = [s for s in SCENARIOS if args.scenario is None or s[1] in args.scenario]
    outcomes = []
    for _ in range(args.rounds):
        for name, flood in chosen:
            for server in servers:
                if server.kind == "candidate" and flood in PLUGIN_FLOODS:
                    continue  # a candidate serves the webhook only
                o = scenario(name, flood, server, args.seconds)
                outcomes.append(o)
                print(_line(o), flush=True)
    if args.out:
        document = {
            "command": "python -m bench.http_floods " + " ".join(sys.argv[1:]),
            "trees": {s.label: s.describe() for s in servers if s.kind == "tree"},
            "candidates": {s.label: s.describe() for s in servers if s.kind == "candidate"},
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python "
            f"{platform.python_version()}, loopback; client, flood and server on the same CPUs",
            "seconds": args.seconds,
            "outcomes": [asdict(o) for o in outcomes],
        }
        args.out.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
