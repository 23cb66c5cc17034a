"""The objects of the scheduler-scale benchmark (pure): layouts, nodes, slices, claims, pods.

Each fake node's ResourceSlices come from the driver's own path: the mock NVML's
inventory of 8 H100-80GB for that node name -> `build_pool` -> `build_slice_specs`,
exactly what the plugin's slice publisher sends. Layouts of the same GPUs:

- `mig`: MIG mode on, driver-managed: every (profile, placement) of every GPU is a
  device (26 per GPU with the whole GPU), consuming the GPU's counter set; a pod asks
  for one 1g.10gb MIG device;
- `mig3`: the same with `--mig-profiles 1g.10gb,3g.40gb,7g.80gb` (11 devices per GPU);
- `whole`: MIG mode off: one device per GPU; a pod asks for a whole GPU;
- `partitions4`: MIG mode off, `--gpu-partitions 4` (the reference's layout): four
  partitions and a full device per GPU, sharing a counter set; a pod asks for a partition;
- `mig3-<variant>`: `mig3`'s slices reshaped in one respect (bench/scale_layouts.py):
  the slice layout's own share of the scheduler's per-node cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench import scale_layouts
from driver.devices.model import PoolOptions, build_pool
from driver.devices.slices import build_slice_specs, slice_documents
from driver.nvml.mock.fleet import Fleet, parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml

DRIVER = "gpu.example.com"
GPUS_PER_NODE = 8
GPU_MODEL = "H100-80GB"
WHOLE_CLASS = DRIVER
MIG_CLASS = f"mig.{DRIVER}"
GPU_PARTITION_CLASS = f"partition.{DRIVER}"
NAMESPACE = "scale"
# Allocatable of every fake node: far more than the pods need, so only devices limit.
NODE_ALLOCATABLE = {"cpu": "64", "memory": "512Gi", "pods": "110"}
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
_ATTRS = f"device.attributes['{DRIVER}']"


@dataclass(frozen=True)
class Layout:
    name: str
    mig_mode: str  # the fleet's migMode: "enabled" or "disabled"
    gpu_partitions: int
    device_class: str
    selector: str | None  # CEL the claim's request adds to its class, if any
    description: str
    mig_profiles: tuple[str, ...] = ()  # --mig-profiles, as labels (empty: every profile)
    reshape: str = ""  # a bench/scale_layouts.py variant of the driver's slices ("": none)

    def fleet(self) -> Fleet:
        group = {"model": GPU_MODEL, "count": GPUS_PER_NODE, "migMode": self.mig_mode}
        return parse_fleet({"gpus": [group]}, source=f"scale layout {self.name}")


MIG3_PROFILES = ("1g10gb", "3g40gb", "7g80gb")
MIG3_VARIANTS = {
    "all-counters": "every MIG dimension counted, as before the driver dropped those that "
    "cannot refuse an allocation",
    "gpu-slices": "one device slice per GPU",
    "set-slices": "one counter-set slice per GPU",
    "few-attributes": "devices with only the attributes selectors read (profile, parentUUID)",
    "slice-counters": "one counter per memory slice, as before the driver counted blocks",
    "one-set": "every GPU's counters in one counter set",
    "mig-first": "each GPU's MIG devices before its whole GPU",
}

LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout(
            "mig",
            "enabled",
            0,
            MIG_CLASS,
            f"{_ATTRS}.profile == '1g.10gb'",
            "every MIG placement (dynamic MIG); a pod asks for a 1g.10gb MIG device",
        ),
        Layout(
            "mig3",
            "enabled",
            0,
            MIG_CLASS,
            f"{_ATTRS}.profile == '1g.10gb'",
            "dynamic MIG with --mig-profiles 1g.10gb,3g.40gb,7g.80gb; a pod asks for a "
            "1g.10gb MIG device",
            mig_profiles=MIG3_PROFILES,
        ),
        *(
            Layout(
                f"mig3-{variant}",
                "enabled",
                0,
                MIG_CLASS,
                f"{_ATTRS}.profile == '1g.10gb'",
                f"mig3 with its slices reshaped: {what}",
                mig_profiles=MIG3_PROFILES,
                reshape=variant,
            )
            for variant, what in MIG3_VARIANTS.items()
        ),
        Layout("whole", "disabled", 0, WHOLE_CLASS, None, "whole GPUs; a pod asks for one"),
        Layout(
            "partitions4",
            "disabled",
            4,
            GPU_PARTITION_CLASS,
            None,
            "--gpu-partitions 4 (the reference's layout); a pod asks for a partition",
        ),
    )
}


# `make bench-scale` without --layouts: the driver's layouts; the mig3 variants on demand.
DEFAULT_LAYOUTS = ("mig", "mig3", "whole", "partitions4")


def node_name(index: int) -> str:
    return f"scale-node-{index:04d}"


def node_slices(layout: Layout, name: str, uid: str, fleet: Fleet | None = None) -> list[Any]:
    """The ResourceSlice documents the plugin would publish on this node."""
    inventory = MockBackend(MockNvml(fleet or layout.fleet(), name)).discover()
    options = PoolOptions(
        driver_name=DRIVER, gpu_partitions=layout.gpu_partitions, mig_profiles=layout.mig_profiles
    )
    specs = build_slice_specs(build_pool(inventory, options), driver=DRIVER, node_name=name)
    specs = scale_layouts.reshape(layout.reshape, specs)
    return slice_documents(specs, driver=DRIVER, node_name=name, node_uid=uid)


def slice_device_count(docs: list[Any]) -> int:
    return sum(len(d["spec"].get("devices", [])) for d in docs)


def node_document(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
    }


def node_status(now: str) -> dict[str, Any]:
    """A Ready status for a Node without a kubelet (merge patch of /status)."""
    return {
        "status": {
            "capacity": NODE_ALLOCATABLE,
            "allocatable": NODE_ALLOCATABLE,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "ScaleBenchmark",
                    "message": "fake node of the scheduler-scale benchmark",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
        }
    }


def device_classes() -> list[dict[str, Any]]:
    """The chart's three DeviceClasses (whole GPUs; MIG partitions; time-shared
    `--gpu-partitions` partitions)."""
    base = f"device.driver == '{DRIVER}'"
    expressions = {
        WHOLE_CLASS: f"{base} && !('profile' in {_ATTRS}) && !('partition' in {_ATTRS})",
        MIG_CLASS: f"{base} && 'profile' in {_ATTRS}",
        GPU_PARTITION_CLASS: f"{base} && 'partition' in {_ATTRS}",
    }
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": expression}}]},
        }
        for name, expression in expressions.items()
    ]


def claim_document(layout: Layout, name: str) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": layout.device_class}
    if layout.selector:
        exactly["selectors"] = [{"cel": {"expression": layout.selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def pod_document(name: str, claim: str, scheduler: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulerName": scheduler,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "main", "image": PAUSE_IMAGE, "resources": {"claims": [{"name": "gpu"}]}}
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        },
    }


def pod_count(nodes: int, cap: int) -> int:
    """Half the whole-GPU layout's capacity (4 pods per node of 8 GPUs), at most `cap`:
    every pod fits in every layout, so all three schedule the same pods."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if cap < 1:
        raise ValueError(f"pod cap must be >= 1, got {cap}")
    return min(GPUS_PER_NODE // 2 * nodes, cap)
