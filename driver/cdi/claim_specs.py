"""CDI spec files: one common spec per driver, one spec per prepared claim.

Names and contents follow the reference driver (example-driver.md §4.4):

- vendor `k8s.<driver>`, class `gpu`, kind `k8s.<driver>/gpu`
  (e.g. `k8s.gpu.example.com/gpu`);
- common spec `<root>/k8s.<driver>-gpu_common.json`, device `common`, env
  `KUBERNETES_NODE_NAME`, `DRA_RESOURCE_DRIVER_NAME`;
- claim spec `<root>/k8s.<driver>-gpu_<claimUID>.json`, one device per prepared
  device named `<claimUID>-<device>[-<shareID>]`;
- compact JSON, `cdiVersion` 0.3.0, or 0.5.0 when a device name starts with a digit
  (claim UIDs usually do); file mode 0600.

Every claim device sets `NVIDIA_VISIBLE_DEVICES=void`, so that an NVIDIA runtime in
its legacy mode adds nothing; on real GPUs it carries its own device nodes, complete
(driver/cdi/device_nodes.py), and the common device the control nodes and the
driver's libraries, binaries and hooks (driver/cdi/driver_edits.py): containerd's CDI
support is all a node needs.
Writes are atomic (temp file in the same directory, rename): a reader sees the old or
the new spec. The common spec is also durable (fsync, directory fsync); claim specs
and their removals are not: the journal holds each prepared claim's spec, and start-up
rewrites a spec a power loss took or garbled and removes one no entry owns
(driver/state/recovery/startup_recovery.py `recover`; docs/state.md, "Durability").
Reads never follow a symlink at the file's path (`read_file_nofollow`).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from driver.cdi.device_nodes import DeviceNode
from driver.cdi.driver_edits import DriverEdits
from driver.fileio import (
    atomic_write,
    read_file_nofollow,
    remove_durably,
    sweep_temp_files,
)

PROFILE: Final = "gpu"
CDI_VERSION: Final = "0.3.0"
CDI_VERSION_MOUNT_TYPE: Final = "0.4.0"  # first version with a mount's type
CDI_VERSION_DIGIT_NAMES: Final = "0.5.0"  # first version allowing names that start with a digit
VISIBLE_DEVICES_VOID: Final = "NVIDIA_VISIBLE_DEVICES=void"
COMMON_DEVICE: Final = "common"
SPEC_MODE: Final = 0o600


def cdi_device_name(claim_uid: str, device_name: str, share_id: str | None) -> str:
    """`<claimUID>-<device>` or `<claimUID>-<device>-<shareID>`."""
    device_id = f"{device_name}-{share_id}" if share_id else device_name
    return f"{claim_uid}-{device_id}"


@dataclass(frozen=True)
class CdiMount:
    """A bind mount of a host directory (an MPS daemon's pipe directory)."""

    host_path: str
    container_path: str

    def to_json(self) -> dict[str, Any]:
        return {
            "hostPath": self.host_path,
            "containerPath": self.container_path,
            "options": ["rw", "nosuid", "nodev", "bind"],
        }

    @classmethod
    def from_json(cls, doc: object) -> CdiMount:
        if not isinstance(doc, Mapping):
            raise ValueError("mount must be an object")
        host, container = doc.get("hostPath"), doc.get("containerPath")
        if not isinstance(host, str) or not isinstance(container, str):
            raise ValueError("mount needs string hostPath and containerPath")
        return cls(host, container)


@dataclass(frozen=True)
class CdiHook:
    """An OCI hook the runtime runs for the container (the CDI spec's `hooks` edit:
    `hookName`, `path`, `args` with argv[0], `env`, `timeout` in seconds)."""

    hook_name: str  # "createRuntime", ...
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"hookName": self.hook_name, "path": self.path}
        if self.args:
            doc["args"] = list(self.args)
        if self.env:
            doc["env"] = list(self.env)
        if self.timeout is not None:
            doc["timeout"] = self.timeout
        return doc

    @classmethod
    def from_json(cls, doc: object) -> CdiHook:
        if not isinstance(doc, Mapping):
            raise ValueError("hook must be an object")
        name, path = doc.get("hookName"), doc.get("path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ValueError("hook needs string hookName and path")
        args, env, timeout = doc.get("args", []), doc.get("env", []), doc.get("timeout")
        for field_name, values in (("args", args), ("env", env)):
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise ValueError(f"hook {field_name} must be a list of strings")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)):
            raise ValueError("hook timeout must be an integer")
        return cls(name, path, tuple(args), tuple(env), timeout)


@dataclass(frozen=True)
class CdiDevice:
    """One device of a claim spec: its CDI name and container edits."""

    name: str
    env: tuple[str, ...]
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[CdiMount, ...] = ()
    hooks: tuple[CdiHook, ...] = ()

    def to_json(self) -> dict[str, Any]:
        edits: dict[str, Any] = {"env": list(self.env)}
        if self.device_nodes:
            edits["deviceNodes"] = [n.to_json() for n in self.device_nodes]
        if self.mounts:
            edits["mounts"] = [m.to_json() for m in self.mounts]
        if self.hooks:  # absent where there are none: specs without stay as they were
            edits["hooks"] = [h.to_json() for h in self.hooks]
        return {"name": self.name, "containerEdits": edits}

    @classmethod
    def from_json(cls, doc: object) -> CdiDevice:
        """Inverse of `to_json`; ValueError names what is malformed."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("name"), str):
            raise ValueError("CDI device must be an object with a string name")
        name = doc["name"]
        edits = doc.get("containerEdits")
        if not isinstance(edits, Mapping):
            raise ValueError(f"CDI device {name}: containerEdits must be an object")
        env, nodes = edits.get("env", []), edits.get("deviceNodes", [])
        if not isinstance(env, list) or not all(isinstance(e, str) for e in env):
            raise ValueError(f"CDI device {name}: env must be a list of strings")
        if not isinstance(nodes, list) or not all(isinstance(n, Mapping) for n in nodes):
            raise ValueError(f"CDI device {name}: deviceNodes must be objects with a path")
        mounts, hooks = edits.get("mounts", []), edits.get("hooks", [])
        for key, value in (("mounts", mounts), ("hooks", hooks)):
            if not isinstance(value, list):
                raise ValueError(f"CDI device {name}: {key} must be a list")
        try:
            parsed = tuple(DeviceNode.from_json(n) for n in nodes)
            bound = tuple(CdiMount.from_json(m) for m in mounts)
            run = tuple(CdiHook.from_json(h) for h in hooks)
        except ValueError as err:
            raise ValueError(f"CDI device {name}: {err}") from None
        return cls(name, tuple(env), parsed, bound, run)


@dataclass(frozen=True)
class ClaimSpec:
    """Everything a claim's CDI spec file holds besides its fixed header. The journal
    keeps it with the claim so the file can be recreated without the API server (the
    CDI root is a tmpfs that a reboot empties while the journal survives).

    `device_nodes` (spec-wide, paths only) is what entries of earlier releases hold:
    the control nodes, which the common spec carries now."""

    devices: tuple[CdiDevice, ...]
    device_nodes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": [d.to_json() for d in self.devices],
            "deviceNodes": list(self.device_nodes),
        }

    @classmethod
    def from_json(cls, doc: object) -> ClaimSpec:
        if not isinstance(doc, Mapping):
            raise ValueError("cdiSpec must be an object")
        devices, nodes = doc.get("devices"), doc.get("deviceNodes", [])
        if not isinstance(devices, list):
            raise ValueError("cdiSpec.devices must be a list")
        if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
            raise ValueError("cdiSpec.deviceNodes must be a list of strings")
        return cls(tuple(CdiDevice.from_json(d) for d in devices), tuple(nodes))


class CdiSpecs:
    """The CDI spec files of one driver in one CDI root directory."""

    def __init__(self, root: Path | str, driver_name: str) -> None:
        self.root = Path(root)
        self.driver_name = driver_name
        self.vendor = f"k8s.{driver_name}"
        self.kind = f"{self.vendor}/{PROFILE}"
        self._prefix = f"{self.vendor}-{PROFILE}_"

    def qualified(self, device: str) -> str:
        """Fully qualified CDI device id, `k8s.<driver>/gpu=<device>`."""
        return f"{self.kind}={device}"

    def device_ids(self, claim_uid: str, device_name: str, share_id: str | None) -> list[str]:
        """The CDI ids the kubelet gets for one prepared device: the device, then common.

        The device's own id comes first because the kubelet reports device health in
        the pod status under a device's first CDI id.
        """
        return [
            self.qualified(cdi_device_name(claim_uid, device_name, share_id)),
            self.qualified(COMMON_DEVICE),
        ]

    @property
    def common_spec_path(self) -> Path:
        return self.root / f"{self._prefix}{COMMON_DEVICE}.json"

    def claim_spec_path(self, claim_uid: str) -> Path:
        return self.root / f"{self._prefix}{claim_uid.replace('/', '_')}.json"

    def _render(self, version: str, devices: list[Any], edits: dict[str, Any]) -> bytes:
        return json.dumps(
            {"cdiVersion": version, "kind": self.kind, "devices": devices, "containerEdits": edits},
            separators=(",", ":"),
        ).encode()

    def write_common_spec(
        self,
        node_name: str,
        driver: DriverEdits | None = None,
        control_nodes: Sequence[DeviceNode] = (),
    ) -> Path:
        """(Re)write the common spec: node name and driver name for every container;
        on real GPUs also the control nodes and the driver's mounts, hooks and env."""
        self.root.mkdir(parents=True, exist_ok=True)
        extra = dict(driver.edits) if driver is not None else {}
        edits: dict[str, Any] = {
            "env": [
                f"KUBERNETES_NODE_NAME={node_name}",
                f"DRA_RESOURCE_DRIVER_NAME={self.driver_name}",
                *extra.pop("env", []),
            ]
        }
        if control_nodes:
            edits["deviceNodes"] = [n.to_json() for n in control_nodes]
        edits.update(extra)
        typed = any(m.get("type") for m in edits.get("mounts", []))
        version = CDI_VERSION_MOUNT_TYPE if typed else CDI_VERSION
        path = self.common_spec_path
        devices = [{"name": COMMON_DEVICE, "containerEdits": edits}]
        atomic_write(path, self._render(version, devices, {}), mode=SPEC_MODE)
        return path

    def write_claim_spec(
        self, claim_uid: str, spec: ClaimSpec, *, before_rename: str | None = None
    ) -> Path:
        """Atomically write (or replace) the claim's spec, not durably (the module
        doc says why). `before_rename`: failpoint."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.claim_spec_path(claim_uid)
        atomic_write(
            path,
            self.render_claim_spec(spec),
            mode=SPEC_MODE,
            before_rename=before_rename,
            durable=False,
        )
        return path

    def render_claim_spec(self, spec: ClaimSpec) -> bytes:
        """The bytes `write_claim_spec` writes for `spec`."""
        digits = any(d.name[:1].isdigit() for d in spec.devices)
        nodes = [{"path": p} for p in spec.device_nodes]
        return self._render(
            CDI_VERSION_DIGIT_NAMES if digits else CDI_VERSION,
            [d.to_json() for d in spec.devices],
            {"deviceNodes": nodes} if nodes else {},
        )

    def remove_claim_spec(self, claim_uid: str) -> bool:
        """Delete the claim's spec (not durably); False if there was none."""
        return remove_durably(self.claim_spec_path(claim_uid), sync_dir=False)

    def remove_claim_specs(self, uids: Sequence[str]) -> tuple[set[str], dict[str, OSError]]:
        """Remove the claims' specs. Returns the UIDs whose spec is gone and the
        errors of the others."""
        gone: set[str] = set()
        errors: dict[str, OSError] = {}
        for uid in uids:
            try:
                self.remove_claim_spec(uid)
                gone.add(uid)
            except OSError as err:
                errors[uid] = err
        return gone, errors

    def sweep_temp_files(self) -> list[Path]:
        """Remove spec temp files left by a crash (call under the serialize lock)."""
        return sweep_temp_files(self.root, self._prefix)

    def claim_spec_exists(self, claim_uid: str) -> bool:
        """A regular file is at the claim's spec path. A symlink there is not the
        claim's spec (never followed), so prepare rewrites the spec over it."""
        try:
            return stat.S_ISREG(os.lstat(self.claim_spec_path(claim_uid)).st_mode)
        except FileNotFoundError:
            return False

    def list_claim_specs(self) -> dict[str, Path]:
        """`{claim UID (as in the file name): path}` of every claim spec in the root.
        Only regular files count: a symlink (or anything else) named like a claim spec
        is not one of ours, so nothing reads or removes through it."""
        try:
            with os.scandir(self.root) as entries:
                names = sorted(e.name for e in entries if e.is_file(follow_symlinks=False))
        except FileNotFoundError:
            return {}
        common = self.common_spec_path.name
        return {
            name[len(self._prefix) : -len(".json")]: self.root / name
            for name in names
            if name != common and name.startswith(self._prefix) and name.endswith(".json")
        }

    def claim_spec_is(self, claim_uid: str, spec: ClaimSpec) -> bool:
        """Is the claim's spec on disk exactly what `write_claim_spec(spec)` writes?
        False for a missing, partial or different one, and for a symlink."""
        try:
            on_disk = read_file_nofollow(self.claim_spec_path(claim_uid))
        except OSError:
            return False
        return on_disk == self.render_claim_spec(spec)

    def read_claim_spec(self, claim_uid: str) -> dict[str, Any] | None:
        """The parsed claim spec, or None if absent. A symlink at the path is refused
        (`UnsafeFileError`, errno ELOOP), never followed."""
        try:
            raw = read_file_nofollow(self.claim_spec_path(claim_uid))
        except FileNotFoundError:
            return None
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError(f"CDI spec {self.claim_spec_path(claim_uid)} is not a JSON object")
        return doc
