"""Prepare/unprepare of one claim in-process, without gRPC or an API server:
`python -m bench.profile_state [--cycles N]` prints p50 of each, the max RSS and the
cProfile top; bench/ab_state.sh runs it for two revisions in turn.

The state machine alone (`DeviceState` over the reference's `example` GPUs, a claim
reader that answers from memory, the plugin directories under --dir on the disk under
test), so the bench's per-call figures can be split into state and transport.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from driver.devices.model import PoolOptions, build_pool
from driver.nvml.selection import select_backend
from driver.state.prepare import DeviceState
from driver.state.request import ClaimRef

UID = "0a0a0a0a-0000-4000-8000-00000000000a"
NODE = "node-a"
CLAIM: dict[str, Any] = {
    "metadata": {"namespace": "default", "name": "c", "uid": UID},
    "status": {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": "gpu.example.com", "pool": NODE, "device": "gpu-0"}
                ],
                "config": [],
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                ]
            },
        }
    },
}


class MemoryClaims:
    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(CLAIM)


class Healthy:
    def failure(self, device_name: str) -> None:
        return None

    def ensure_tainted(self, device_name: str) -> None:
        return None


class NoReports:
    def permanent_failure(self, claim: object, error: object) -> None:
        raise AssertionError(f"unexpected permanent error: {error}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_state", description=__doc__)
    p.add_argument("--cycles", type=int, default=200)
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="disk under test")
    args = p.parse_args(argv)
    inventory = select_backend(mock=True, fleet_path="example", node_name=NODE).discover()
    devices = {d.name: d for d in build_pool(inventory, PoolOptions()).devices}
    root = Path(tempfile.mkdtemp(prefix="gpu-dra-profile-", dir=args.dir))
    state = DeviceState(
        driver_name="gpu.example.com",
        node_name=NODE,
        devices=devices,
        cdi_root=root / "cdi",
        data_dir=root / "plugin",
        claims=MemoryClaims(),
        health=Healthy(),
        reporter=NoReports(),
    )
    ref = ClaimRef("default", "c", UID)
    prepare_s: list[float] = []
    unprepare_s: list[float] = []
    for i in range(args.cycles + 20):  # the first 20 warm up
        t0 = time.perf_counter()
        result = state.prepare([ref])[UID]
        t1 = time.perf_counter()
        errors = state.unprepare([ref])
        t2 = time.perf_counter()
        if not result.ok or errors != {UID: None}:
            raise SystemExit(f"cycle {i} failed: {result.error} {errors}")
        if i >= 20:
            prepare_s.append(t1 - t0)
            unprepare_s.append(t2 - t1)
    print(
        f"{args.cycles} cycles in {root}: prepare p50 {statistics.median(prepare_s) * 1000:.2f} ms,"
        f" unprepare p50 {statistics.median(unprepare_s) * 1000:.2f} ms,"
        f" max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} KiB"
    )
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.cycles):
        state.prepare([ref])
        state.unprepare([ref])
    profile.disable()
    shutil.rmtree(root)
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
