"""A node's prepare/unprepare on a given NVML backend, built as the plugin builds it
(driver/plugin/main.py): DeviceState with the backend's MIG manager and kernel root,
`recover()` first, then discovery and the journal's owned MIG devices under the node
lock, then the published pool. The claims are in memory; every device is healthy.
MPS daemons run where the plugin's `--mps-daemons` puts them (`mps_daemons`: e.g.
`NodeDaemons`, processes of the node), a whole GPU published `mpsIsolation: "strict"`
held in EXCLUSIVE_PROCESS through the backend's compute modes, as the plugin does;
`allow_multiple_allocations` publishes whole GPUs for shares
(`--gpu-allow-multiple-allocations`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.cdi.driver_edits import DriverRoot
from driver.devices.model import MigStrategy, PoolDevices, PoolOptions, build_pool
from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import MigInstance
from driver.nvml.selection import select_backend
from driver.state.mig_instances import MigOps
from driver.state.mps.daemons import MpsDaemons
from driver.state.prepare import DeviceState
from driver.state.recovery.startup_recovery import RecoveryReport
from driver.state.request import ClaimRef
from tests.state_fakes import Healthy, NoReports

DRIVER = "gpu.example.com"
NODE = "gpu-node"


def host_backend() -> NvmlBackend:
    """The host's libnvidia-ml through pynvml (never the mock)."""
    return select_backend(mock=False)


@dataclass
class ClaimDocs:
    """Allocated ResourceClaims as the API server would return them; a claim's name
    is its UID."""

    docs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, uid: str, *devices: str) -> ClaimRef:
        results = [
            {"request": f"r{i}", "driver": DRIVER, "pool": NODE, "device": d}
            for i, d in enumerate(devices)
        ]
        self.docs[uid] = {
            "metadata": {"namespace": "default", "name": uid, "uid": uid},
            "status": {"allocation": {"devices": {"results": results, "config": []}}},
        }
        return ClaimRef("default", uid, uid)

    def add_share(
        self,
        uid: str,
        device: str,
        share_id: str,
        consumed: dict[str, str],
        parameters: dict[str, Any],
    ) -> ClaimRef:
        """A claim given a share of a multi-allocatable device, with its own opaque
        config (`parameters`: a GpuConfig) for the driver."""
        result = {"request": "r0", "driver": DRIVER, "pool": NODE, "device": device}
        result |= {"shareID": share_id, "consumedCapacity": consumed}
        opaque = {"driver": DRIVER, "parameters": parameters}
        config = {"source": "FromClaim", "requests": [], "opaque": opaque}
        self.docs[uid] = {
            "metadata": {"namespace": "default", "name": uid, "uid": uid},
            "status": {"allocation": {"devices": {"results": [result], "config": [config]}}},
        }
        return ClaimRef("default", uid, uid)

    def add_configured(self, uid: str, device: str, parameters: dict[str, Any]) -> ClaimRef:
        """A claim given a whole device with its own opaque config (`parameters`: a
        GpuConfig) for the driver."""
        ref = self.add(uid, device)
        opaque: dict[str, Any] = {"driver": DRIVER, "parameters": parameters}
        config = [{"source": "FromClaim", "requests": [], "opaque": opaque}]
        self.docs[uid]["status"]["allocation"]["devices"]["config"] = config
        return ref

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.docs[name]


@dataclass
class GpuNode:
    backend: NvmlBackend
    state: DeviceState
    claims: ClaimDocs
    pool: PoolDevices
    recovered: RecoveryReport

    def spec(self, uid: str) -> dict[str, Any]:
        doc = self.state.cdi.read_claim_spec(uid)
        assert doc is not None, f"no CDI spec for claim {uid}"
        return doc

    def live(self, gpu_uuid: str) -> list[MigInstance]:
        """The GPU's MIG devices as NVML lists them now."""
        return self.backend.mig().instances(gpu_uuid)

    def published_uuids(self, gpu_uuid: str) -> set[str]:
        """The `uuid` attributes of the devices published for the GPU."""
        return {
            d.document["attributes"]["uuid"]["string"]
            for d in self.pool.devices_of_gpu(gpu_uuid)
            if "uuid" in d.document["attributes"]
        }


def open_node(
    backend: NvmlBackend,
    root: Path,
    strategy: MigStrategy = MigStrategy.AUTO,
    *,
    mig: MigOps | None = None,
    driver_root: DriverRoot | None = None,
    mps_daemons: MpsDaemons | None = None,
    allow_multiple_allocations: bool = False,
    gpu_partitions: int = 0,
    mps_strict_partitions: bool = False,
) -> GpuNode:
    """The node whose journal and CDI specs live under `root`; a second call on the
    same root is a plugin restart. `mig`: the MIG manager, if not the backend's;
    `gpu_partitions`: `--gpu-partitions`, `mps_strict_partitions`:
    `--mps-strict-partitions`. Its devices carry `mpsIsolation` where it
    runs MPS daemons, as the plugin publishes them."""
    claims = ClaimDocs()
    state = DeviceState(
        driver_name=DRIVER,
        node_name=NODE,
        devices={},
        cdi_root=root / "cdi",
        data_dir=root / "plugin",
        claims=claims,
        health=Healthy(),
        reporter=NoReports(),
        real_devices=True,
        mig=mig or backend.mig(),
        caps_root=backend.kernel_root,
        proc_devices=backend.kernel_root / "proc" / "devices",
        driver_root=driver_root,
        mps_daemons=mps_daemons,
        compute_modes=backend.compute_modes(),
    )
    recovered = state.recover()
    inventory, owned = state.discover_with_owned(backend.discover)
    options = PoolOptions(
        mig_strategy=strategy,
        allow_multiple_allocations=allow_multiple_allocations,
        gpu_partitions=gpu_partitions,
        mps=state.mps.site is not None,
        mps_strict_partitions=mps_strict_partitions,
    )
    pool = build_pool(inventory, options, owned_mig=owned)
    state.devices = {d.name: d for d in pool.devices}
    return GpuNode(backend, state, claims, pool, recovered)


def spec_mig_uuid(spec: dict[str, Any], uid: str, device: str) -> str | None:
    """The MIG UUID the claim's CDI spec hands the container for `device`: the spec's
    device `<uid>-<device>` has `GPU_DEVICE_<id>=<device>` and
    `GPU_DEVICE_<id>_UUID=<MIG UUID>` in its env, which ends in
    `NVIDIA_VISIBLE_DEVICES=void`."""
    (cdi,) = [d for d in spec["devices"] if d["name"] == f"{uid}-{device}"]
    lines = cdi["containerEdits"]["env"]
    assert lines[-1] == "NVIDIA_VISIBLE_DEVICES=void", lines
    env = dict(line.split("=", 1) for line in lines)
    (key,) = [k for k, v in env.items() if k.startswith("GPU_DEVICE_") and v == device]
    return env.get(f"{key}_UUID")
