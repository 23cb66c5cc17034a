"""Prepare/unprepare of one claim in-process, without gRPC or an API server:
`python -m bench.profile_state [--cycles N]` prints p50 of each, the max RSS, the
cProfile top of the prepares and their time per stage (docs/architecture.md, "One
claim's prepare, one pass"); bench/ab_state.sh runs it for two revisions in turn.

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


# (stage, module, its functions the facade calls): their cumulative time in the profile.
STAGES = (
    ("1 decode", "state/request.py", ("read_claims", "check_claim", "check_health")),
    ("  journal load", "state/context.py", ("load_journal",)),
    ("2 plan", "state/plan.py", ("plan_batch",)),
    ("3 apply", "state/apply.py", ("clear_the_way", "create_mig", "share")),
    ("4-5 commit", "state/commit.py", ("store_intent", "write_specs", "complete")),
)


def print_stages(profile: cProfile.Profile, cycles: int) -> None:
    """Each stage's time per prepare under the profiler (which slows every call alike),
    and its share of the whole prepare call."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]

    def per_call_ms(module: str, names: tuple[str, ...]) -> float:
        seconds = sum(
            cumulative
            for (path, _, name), (_, _, _, cumulative, _) in stats.items()
            if path.endswith(module) and name in names
        )
        return seconds / cycles * 1000

    whole = per_call_ms("state/prepare.py", ("prepare",))
    print(f"prepare under cProfile: {whole:.3f} ms per call, by stage:")
    for label, module, names in STAGES:
        ms = per_call_ms(module, names)
        print(f"  {label:<14} {ms:.3f} ms  {ms / whole:5.1%}  {module}")


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
    for _ in range(args.cycles):
        profile.enable()
        state.prepare([ref])
        profile.disable()
        state.unprepare([ref])
    shutil.rmtree(root)
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    print_stages(profile, args.cycles)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
