"""Two claims' MPS shares of one GPU, both busy, against one alone (docs/mps.md,
"Time-slicing between servers"): each share has an MPS server of its own, a CUDA
context of its own, and the GPU time-slices contexts. A busy client
(tests/gpu/cuda_busy.py: the same grid of dependent multiply-adds, launched again and
again for a fixed time) runs on one share alone, then one on each share at once.

The numbers (launches per second, the SM count each context reports) are recorded, not
judged; what is asserted is only what MPS guarantees: each share of the pair gets
work done, and the pair together does not get more than about one share alone
(`PAIR_OVER_ALONE`: time-sliced, not concurrent). Compute mode `Default` (two servers
on one GPU); it is checked unchanged at the end; MIG mode is never touched."""

from __future__ import annotations

import os
import re
from pathlib import Path

from driver.nvml.discovered import GpuInfo
from driver.nvml.mps import MpsControl
from tests.gpu.bound_clients import Client, reach, release
from tests.gpu.mps_clients import BUSY, Daemon, Share, node_daemons, record, start, stop
from tests.gpu.mps_gate import SEVERAL_SERVERS, compute_mode, require_mps

ROOT = Path(os.environ.get("NVIDIA_DRIVER_ROOT") or "/")
SECONDS = 5.0
SHARES = (Share("busy-a", 50, 4096), Share("busy-b", 50, 4096))
PAIR_OVER_ALONE = 1.2
_BUSY = re.compile(r"busy launches=(\d+) seconds=([\d.]+)$")
_SMS = re.compile(r"sm context=(.+) device=(\d+)$")


def _rates(clients: list[Client]) -> list[float]:
    """Launches per second of each client, all started at once."""
    reach(clients, "ready")
    release(clients)
    reach(clients, "done")
    rates = []
    for client in clients:
        found = [m for m in map(_BUSY.match, client.lines) if m]
        sms = [m for m in map(_SMS.match, client.lines) if m]
        assert found, client.said()
        launches, seconds = int(found[0][1]), float(found[0][2])
        print(f"{client.name}: {launches} launches in {seconds:.2f}s, {sms[0][0] if sms else ''}")
        rates.append(launches / seconds)
    return rates


def _busy(name: str, daemon: Daemon, pipe: Path, uuid: str) -> Client:
    return start(name, pipe, uuid, namespace_of=daemon.record.pid, script=BUSY, args=[str(SECONDS)])


def test_two_busy_shares_together_get_no_more_than_one_alone(
    whole_gpu: GpuInfo, tmp_path: Path
) -> None:
    uuid = whole_gpu.uuid
    mode = require_mps(ROOT, uuid, SEVERAL_SERVERS)
    control = MpsControl(ROOT)
    with node_daemons(control, tmp_path / "mps", uuid, SHARES) as (mps, daemons):
        alone = [_busy("alone", daemons[0], daemons[0].pipe(mps), uuid)]
        try:
            (rate_alone,) = _rates(alone)
        finally:
            stop(alone)
        pair = [_busy(d.share.name, d, d.pipe(mps), uuid) for d in daemons]
        try:
            rates = _rates(pair)
        finally:
            stop(pair)
    assert rate_alone > 0, "no launch finished alone"
    record("throughput_alone_per_s", f"{rate_alone:.2f}")
    record("throughput_pair_per_s", "/".join(f"{r:.2f}" for r in rates))
    record("throughput_pair_over_alone", f"{sum(rates) / rate_alone:.3f}")
    assert all(rate > 0 for rate in rates), rates
    assert sum(rates) <= PAIR_OVER_ALONE * rate_alone, (rates, rate_alone)
    assert compute_mode(uuid) == mode
