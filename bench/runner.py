"""One driver's turn: every selected scenario of one repetition, on the same node and
cluster as the other drivers' turns (bench.run orders the turns)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import yaml

from bench import scenarios as sc
from bench.cluster import NODE_NAME, Api
from bench.plugins import DRIVER, NvidiaPlugin, OursPlugin, PluginUnderTest, ReferencePlugin
from tests.conftest import free_ports

SCENARIOS = (
    "prepare",
    "batch",
    "permanent",
    "xid",
    "mig",
    "resync",
    "restart",
    "publish64",
    "mig64",
    "floor",
)
UNTHROTTLED = ("--kube-api-qps=1000", "--kube-api-burst=1000")
REPO = Path(__file__).resolve().parents[1]
# A dynamic MIG partition of the default fleet (1g.10gb at placement 0 of GPU 1) and the
# whole GPU 2, which on a MIG GPU is delivered as a full-size MIG device.
MIG_PARTITION = "gpu-1-mig-1g10gb-0"
MIG_WHOLE_GPU = "gpu-2"


def claim_name(name: str, driver: str) -> str:
    """The API name of the bench's claim `name` for `driver`: this driver and the
    reference share theirs; another driver's carry its vendor (`single-nvidia`)."""
    return name if driver == DRIVER else f"{name}-{driver.split('.')[1]}"


class Runner:
    def __init__(self, args: argparse.Namespace, api: Api, kubeconfig: Path, work: Path) -> None:
        self.args = args
        self.api = api
        self.kubeconfig = kubeconfig
        self.work = work
        self.selected = set(args.scenario or SCENARIOS)
        self.watcher = sc.SliceWatcher(api, NODE_NAME).start()
        fleets = work / "fleets"
        fleets.mkdir(parents=True, exist_ok=True)
        self.fleet_example64 = fleets / "example-64.yaml"
        self.fleet_example64.write_text(
            yaml.safe_dump({"gpus": [{"model": "example", "count": 64}]})
        )
        self.fleet_h100_64 = fleets / "h100-64.yaml"
        self.fleet_h100_64.write_text(
            yaml.safe_dump({"gpus": [{"model": "H100-80GB", "count": 64}]})
        )
        self._claims: dict[tuple[str, str], sc.ClaimRef] = {}
        self._batch: dict[str, list[sc.ClaimRef]] = {}
        self.pycache = work / "pycache"
        self.compile_bytecode()

    def compile_bytecode(self) -> None:
        """Compile the driver and its dependencies into the plugins' bytecode cache before
        anything is timed, as pip does at install: no start-up pays for compilation."""
        self.log("compiling bytecode for this driver's starts")
        roots = [str(REPO / "driver"), *sysconfig.get_paths()["purelib"].split(os.pathsep)]
        subprocess.run(
            [sys.executable, "-m", "compileall", "-q", "-j", "0", *roots],
            env={**os.environ, "PYTHONPYCACHEPREFIX": str(self.pycache)},
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def want(self, name: str) -> bool:
        return name in self.selected

    def claim(
        self, name: str, device: str, config: Any = None, driver: str = DRIVER
    ) -> sc.ClaimRef:
        if (driver, name) not in self._claims:
            self._claims[driver, name] = sc.allocated_claim(
                self.api, NODE_NAME, claim_name(name, driver), device, config, driver
            )
        return self._claims[driver, name]

    def plugin(self, kind: str, phase: str, repetition: int) -> PluginUnderTest:
        root = self.work / f"{kind}-{repetition}" / phase
        if kind == "ours":
            port = free_ports(1)[0]
            return OursPlugin(root, self.kubeconfig, NODE_NAME, port, self.pycache)
        if kind == "nvidia":
            return NvidiaPlugin(
                Path(self.args.nvidia_plugin),
                Path(self.args.nvidia_nvml_root),
                root,
                self.kubeconfig,
                NODE_NAME,
                extra_args=UNTHROTTLED,
            )
        # "reference" runs with its defaults (client-side rate limit: 5 QPS, burst 10,
        # and it GETs every claim it prepares); "reference_unthrottled" without it.
        extra = UNTHROTTLED if kind == "reference_unthrottled" else ()
        return ReferencePlugin(
            Path(self.args.reference), root, self.kubeconfig, NODE_NAME, extra_args=extra
        )

    def gpus(self, kind: str, what: str) -> str:
        if kind == "ours":
            return {
                "8": "default",
                "64": str(self.fleet_example64),
                "mig64": str(self.fleet_h100_64),
            }[what]
        return what  # the reference: --num-devices; NVIDIA's: the mock's GPU count

    def log(self, msg: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def driver(self, kind: str, repetition: int) -> dict[str, Any]:
        """One repetition of every selected scenario for one driver."""
        out: dict[str, Any] = {}
        a = self.args
        ours = kind == "ours"
        # Phase A: 8 GPUs (ours: the default fleet, 8 H100 with every MIG placement).
        sc.delete_node_slices(self.api, NODE_NAME)
        plugin = self.plugin(kind, "8gpu", repetition)
        self.log(f"{kind} #{repetition}: start with 8 GPUs")
        kubelet, out["start_8gpu"] = sc.start_and_publish(
            plugin, self.gpus(kind, "8"), self.api, self.watcher
        )
        try:
            if ours and self.want("permanent"):
                bad = self.claim(
                    "bad-config",
                    "gpu-1",
                    {
                        "apiVersion": "gpu.resource.example.com/v1alpha1",
                        "kind": "GpuConfig",
                        "sharing": {
                            "strategy": "SpacePartitioning",
                            "spacePartitioningConfig": {"partitionCount": 64},
                        },
                    },
                )
                self.log(f"{kind}: permanent error x {a.iterations}")
                assert isinstance(plugin, OursPlugin)
                out["permanent_repeat"] = sc.permanent_error_repeats(
                    kubelet, plugin, bad, a.iterations
                )
            if ours and self.want("mig"):
                assert isinstance(plugin, OursPlugin)
                for key, name, device in (
                    ("mig_partition", "mig-partition", MIG_PARTITION),
                    ("mig_whole_gpu", "mig-whole-gpu", MIG_WHOLE_GPU),
                ):
                    ref = self.claim(name, device)
                    sc.prepare_single(kubelet, ref, 2)  # warm-up
                    self.log(f"{kind}: {device} (dynamic MIG) x {a.mig_iterations}")
                    out[key] = sc.mig_cycles(kubelet, plugin, ref, a.mig_iterations)
            if ours and self.want("xid"):
                self.log(f"{kind}: {a.xid_injections} Xid injections")
                assert isinstance(plugin, OursPlugin)
                out["xid_to_taint"] = sc.xid_to_taint(plugin, self.watcher, a.xid_injections)
            out["rss_kib_8gpu"] = plugin.rss_kib()
            if self.want("resync"):
                out["resync_8gpu"] = sc.resync_writes(plugin, self.api, self.watcher)
            if self.want("restart"):
                self.log(f"{kind}: restart with the slices in place")
                kubelet, out["restart_8gpu"] = sc.restart_writes(
                    plugin, self.gpus(kind, "8"), self.api, self.watcher, kubelet
                )
        finally:
            plugin.stop()
            kubelet.stop()

        # Phase B: 64 whole GPUs (ours: 64 `example` GPUs, the reference's device
        # model): the like-for-like prepare rows.
        if self.want("prepare") or self.want("batch") or self.want("publish64"):
            sc.delete_node_slices(self.api, NODE_NAME)
            plugin = self.plugin(kind, "64gpu", repetition)
            self.log(f"{kind}: start with 64 GPUs")
            kubelet, out["start_64gpu"] = sc.start_and_publish(
                plugin, self.gpus(kind, "64"), self.api, self.watcher
            )
            try:
                driver = plugin.driver
                single = self.claim("single", "gpu-0", driver=driver)
                sc.prepare_single(kubelet, single, 5, driver)  # warm-up
                if self.want("prepare"):
                    self.log(f"{kind}: 1 claim x {a.iterations}")
                    before = plugin.handler_seconds() if isinstance(plugin, OursPlugin) else None
                    out["prepare_1"] = sc.prepare_single(kubelet, single, a.iterations, driver)
                    if isinstance(plugin, OursPlugin) and before is not None:
                        (s0, n0), (s1, n1) = before, plugin.handler_seconds()
                        out["prepare_1"]["handler_mean_ms"] = round((s1 - s0) / (n1 - n0) * 1e3, 3)
                if self.want("batch") and out["start_64gpu"]["devices"] < 64:
                    out["skipped"] = {
                        "batch": f"{out['start_64gpu']['devices']} devices published, not 64"
                        " (NVIDIA's mock NVML simulates 8 GPUs unless its cap is raised)"
                    }
                elif self.want("batch"):
                    if driver not in self._batch:
                        self._batch[driver] = [
                            self.claim(f"batch-{i}", f"gpu-{i}", driver=driver) for i in range(64)
                        ]
                    batch = self._batch[driver]
                    sc.prepare_batch(kubelet, batch, 1, driver)  # warm-up
                    rounds = a.batch_rounds if kind != "reference" else a.throttled_batch_rounds
                    self.log(f"{kind}: 64-claim batch x {rounds}")
                    out["prepare_64"] = sc.prepare_batch(kubelet, batch, rounds, driver)
                out["rss_kib_64gpu"] = plugin.rss_kib()
                if self.want("resync"):
                    out["resync_64gpu"] = sc.resync_writes(plugin, self.api, self.watcher)
            finally:
                plugin.stop()
                kubelet.stop()

        # Phase C (this driver only): 64 H100 with every MIG placement.
        if ours and self.want("mig64"):
            sc.delete_node_slices(self.api, NODE_NAME)
            plugin = self.plugin(kind, "mig64", repetition)
            self.log(f"{kind}: start with 64 MIG-capable GPUs")
            kubelet, out["start_mig64"] = sc.start_and_publish(
                plugin, self.gpus(kind, "mig64"), self.api, self.watcher
            )
            try:
                out["rss_kib_mig64"] = plugin.rss_kib()
                if self.want("resync"):
                    out["resync_mig64"] = sc.resync_writes(plugin, self.api, self.watcher)
            finally:
                plugin.stop()
                kubelet.stop()
        return out
