"""A claim's memory share as a hard limit on its containers' cgroups (NVML R615 and
later; docs/mps.md, "Memory limits the kernel driver keeps"): the `createRuntime`
hook the CDI spec carries, run with /bin/sh against a fake OCI state and the plugin's
request thread; the thread with the mock at 615 setting the limit on the cgroup of
the pid; no hook at 580 or for a device without a memory share."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver.cdi.claim_specs import CdiDevice, ClaimSpec
from driver.cdi.memory_limit_hook import (
    HOOK_PATH,
    MemoryLimitSite,
    memory_share_bytes,
    request_dir,
    site_for,
)
from driver.devices.model import PoolOptions
from driver.nvml.cgroups import cgroup_dir
from driver.nvml.memory_limits import GpuMemoryLimits, MemoryLimitError
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_processes import container_cgroup
from driver.nvml.mock.nvml import MockNvml
from driver.plugin.memory_limit_requests import (
    ForgetRequestsOnUnprepare,
    MemoryLimitRequests,
    parse_request,
    probe_site,
    serve_memory_limits,
)
from driver.state.prepare import DeviceState
from tests.unit.test_mps_prepare import Node, mps_node, ok
from tests.unit.test_mps_shares import claim

GIB = 1 << 30
POD = "0d5f2c1e-1111-4a2b-9c3d-123456789abc"
GPU = "GPU-00000000-0000-0000-0000-000000000000"


def fleet(driver_version: str) -> Any:
    return parse_fleet(
        {
            "gpus": [{"model": "H100-80GB", "count": 1, "migMode": "disabled"}],
            "driverVersion": driver_version,
        }
    )


class FakeLimits:
    """`limit_process` that records its calls, or refuses with `error`."""

    def __init__(self, error: str | None = None) -> None:
        self.error = error
        self.calls: list[tuple[str, int, int]] = []

    def limit_process(self, gpu_uuid: str, pid: int, hard_bytes: int, **_: Any) -> str:
        self.calls.append((gpu_uuid, pid, hard_bytes))
        if self.error is not None:
            raise MemoryLimitError(self.error, "NVML_ERROR_INVALID_ARGUMENT")
        return "/sys/fs/cgroup/c"


def run_hook(
    site: MemoryLimitSite, state: dict[str, Any], share: int = 2 * GIB
) -> subprocess.CompletedProcess[str]:
    (hook,) = site.hooks("claim-uid-1", GPU, share)
    assert hook.path == HOOK_PATH and hook.hook_name == "createRuntime"
    return subprocess.run(
        [hook.path, *hook.args[1:]],
        input=json.dumps(state),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def site(tmp_path: Path) -> MemoryLimitSite:
    found = site_for(tmp_path / "plugin", [GPU], wait_seconds=2)
    assert found is not None
    found.directory.mkdir(parents=True, mode=0o700)
    return found


class Plugin:
    """The plugin's request thread, answering with `limits`."""

    def __init__(self, site: MemoryLimitSite, limits: Any) -> None:
        self.requests = MemoryLimitRequests(site.directory, limits, poll_seconds=0.01)

    def __enter__(self) -> MemoryLimitRequests:
        self.requests.start()
        return self.requests

    def __exit__(self, *_: object) -> None:
        self.requests.stop()


OCI_STATE = {"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 4242}


def test_the_hook_exits_0_once_the_plugin_set_the_limit(site: MemoryLimitSite) -> None:
    limits = FakeLimits()
    with Plugin(site, limits) as requests:
        done = run_hook(site, OCI_STATE)
    assert done.returncode == 0, done.stderr
    assert limits.calls == [(GPU, 4242, 2 * GIB)]
    assert requests.answered == 1
    assert list(site.directory.iterdir()) == []  # request and answer gone


def test_the_hook_fails_with_the_plugins_error(site: MemoryLimitSite) -> None:
    with Plugin(site, FakeLimits(error="GPU x: cgroup refused the limit")):
        done = run_hook(site, OCI_STATE)
    assert done.returncode == 1
    assert "cgroup refused the limit" in done.stderr
    assert list(site.directory.iterdir()) == []


def test_the_hook_fails_closed_without_an_answer(tmp_path: Path) -> None:
    site = site_for(tmp_path, [GPU], wait_seconds=1)
    assert site is not None
    site.directory.mkdir()
    done = run_hook(site, OCI_STATE)  # no plugin answers
    assert done.returncode == 1
    assert "did not set the memory limit" in done.stderr
    assert list(site.directory.iterdir()) == []


def test_a_state_without_a_pid_is_answered_with_an_error(site: MemoryLimitSite) -> None:
    limits = FakeLimits()
    with Plugin(site, limits):
        done = run_hook(site, {"id": "c1", "status": "creating"})
    assert done.returncode == 1 and "no container pid" in done.stderr
    assert limits.calls == []


def test_the_hook_edit_is_a_create_runtime_hook_with_a_timeout(site: MemoryLimitSite) -> None:
    (hook,) = site.hooks("claim-uid-1", GPU, 3 * GIB)
    doc = hook.to_json()
    assert doc["hookName"] == "createRuntime" and doc["path"] == "/bin/sh"
    assert doc["args"][:2] == ["sh", "-c"]
    assert doc["args"][4:] == [str(site.directory), "claim-uid-1", GPU, str(3 * GIB), "2"]
    assert doc["timeout"] == 2 + 5  # past the script's own wait
    # It survives the journal's round trip, so a spec rewritten from it is the same.
    spec = ClaimSpec((CdiDevice("claim-uid-1-gpu-0", ("A=1",), hooks=(hook,)),))
    assert ClaimSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert site.hooks("c", GPU, None) == () and site.hooks("c", "GPU-other", GIB) == ()


def test_the_memory_share_is_the_mps_limit_else_the_consumed_memory() -> None:
    assert memory_share_bytes(pinned_memory_bytes=2 * GIB, share_id="s", consumed={}) == 2 * GIB
    assert memory_share_bytes(
        pinned_memory_bytes=None, share_id="s", consumed={"memory": "16Gi"}
    ) == (16 * GIB)
    assert memory_share_bytes(pinned_memory_bytes=None, share_id=None, consumed={}) is None
    assert memory_share_bytes(pinned_memory_bytes=None, share_id="s", consumed={}) is None


def test_a_request_is_the_gpu_the_bytes_and_the_oci_state() -> None:
    data = f"{GPU} 1024\n".encode() + json.dumps(OCI_STATE).encode()
    assert parse_request(data) == (GPU, 1024, 4242)


# -- the thread with the mock's NVML -------------------------------------------------


def mock_nvml(tmp_path: Path, version: str) -> MockNvml:
    mock = MockNvml(fleet(version), "node-a", driver_root=tmp_path / "root")
    mock.nvmlInit()
    mock.privileged = True
    return mock


def test_the_thread_sets_the_share_on_the_cgroup_of_the_pid_at_615(tmp_path: Path) -> None:
    mock = mock_nvml(tmp_path, "615.71.09")
    limits = GpuMemoryLimits(mock)
    root = tmp_path / "root"
    gpu = mock.nvmlDeviceGetUUID(mock.nvmlDeviceGetHandleByIndex(0))
    site = probe_site(limits, tmp_path / "plugin", [gpu], cgroup_root=root / "sys/fs/cgroup")
    assert site is not None and site.gpus == {gpu}
    # The container's process, as the mock's processes write it (its cgroup exists).
    pid = 4242
    path = container_cgroup(POD, pid)
    (root / "proc" / str(pid)).mkdir(parents=True)
    (root / "proc" / str(pid) / "cgroup").write_text(f"0::{path}\n")
    cgroup = cgroup_dir(root / "sys/fs/cgroup", path)
    cgroup.mkdir(parents=True)
    requests = MemoryLimitRequests(
        site.directory, limits, proc_root=root / "proc", cgroup_root=root / "sys/fs/cgroup"
    )
    requests.start()
    requests.stop()  # the directory made; the passes run by hand below
    assert site.directory.stat().st_mode & 0o777 == 0o700
    state = json.dumps({**OCI_STATE, "pid": pid}).encode()
    (site.directory / "claim-a-1.req").write_bytes(f"{gpu} {3 * GIB}\n".encode() + state)
    assert requests.serve_once() == 1
    assert mock.memory_limits_of(gpu) == {str(cgroup): (0, 3 * GIB)}  # hard only
    assert sorted(p.name for p in site.directory.iterdir()) == ["claim-a-1.ok"]
    # A pid with no cgroup here is refused: the hook fails closed.
    (site.directory / "claim-a-2.req").write_bytes(f"{gpu} {GIB}\n".encode() + b'{"pid": 77}')
    assert requests.serve_once() == 1
    assert "no cgroup v2 path" in (site.directory / "claim-a-2.err").read_text()


def test_a_driver_before_615_has_no_site(tmp_path: Path) -> None:
    mock = mock_nvml(tmp_path, "580.95.05")
    gpu = mock.nvmlDeviceGetUUID(mock.nvmlDeviceGetHandleByIndex(0))
    assert probe_site(GpuMemoryLimits(mock), tmp_path, [gpu]) is None


# -- the claim's CDI spec ----------------------------------------------------------------


@pytest.fixture
def node_615(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(tmp_path, fleet("615.71.09"))


def spec_of(state: DeviceState, uid: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(state.cdi.claim_spec_path(uid).read_text())
    return doc


def with_site(node: Node, state: DeviceState) -> MemoryLimitSite:
    gpu = node.backend.discover().gpus[0].uuid
    site = site_for(node.root / "plugin", [gpu])
    assert site is not None
    state.context = replace(state.context, memory_limits=site)
    return site


def test_a_share_gets_the_hook_with_its_memory(node_615: Node) -> None:
    node_615.options = PoolOptions(allow_multiple_allocations=True)
    state = node_615.state(mps=False)
    site = with_site(node_615, state)
    ok(state, claim(node_615.claims, "a", "gpu-0", consumed={"memory": "16Gi", "compute": "20"}))
    (hook,) = spec_of(state, "a")["devices"][0]["containerEdits"]["hooks"]
    assert hook["args"][4:] == [
        str(site.directory),
        "a",
        node_615.backend.discover().gpus[0].uuid,
        str(16 * GIB),
        "10",
    ]
    # A restart finds the spec as the journal holds it.
    again = node_615.state(mps=False)
    assert again.cdi.claim_spec_is("a", again.checkpoint.load()["a"].cdi_spec)  # type: ignore[arg-type]


def test_an_mps_device_gets_its_pinned_limit(node_615: Node) -> None:
    state = node_615.state()
    with_site(node_615, state)
    ok(state, node_615.claims.add("a"))
    (hook,) = spec_of(state, "a")["devices"][0]["containerEdits"]["hooks"]
    assert hook["args"][7] == str(2 * GIB)  # the daemon's pinned device-memory limit
    assert state.unprepare([node_615.claims.add("a")]) == {"a": None}


def test_a_device_without_a_memory_share_gets_no_hook(node_615: Node) -> None:
    state = node_615.state(mps=False)
    with_site(node_615, state)
    ok(state, claim(node_615.claims, "a", "gpu-0"))  # the whole GPU
    assert "hooks" not in spec_of(state, "a")["devices"][0]["containerEdits"]


def test_without_a_site_the_spec_is_as_before(node_615: Node) -> None:
    """At 580 `probe_site` is None: the context has no site, the spec no hooks key,
    byte for byte what a device without hooks renders."""
    node_615.options = PoolOptions(allow_multiple_allocations=True)
    state = node_615.state(mps=False)
    assert state.context.memory_limits is None
    ok(state, claim(node_615.claims, "a", "gpu-0", consumed={"memory": "16Gi", "compute": "20"}))
    raw = state.cdi.claim_spec_path("a").read_bytes()
    assert b"hooks" not in raw
    stored = state.checkpoint.load()["a"].cdi_spec
    assert stored is not None and all(d.hooks == () for d in stored.devices)
    plain = ClaimSpec(
        tuple(CdiDevice(d.name, d.env, d.device_nodes, d.mounts) for d in stored.devices)
    )
    assert state.cdi.render_claim_spec(plain) == raw


def test_unprepare_removes_the_claims_request_files(site: MemoryLimitSite) -> None:
    requests = MemoryLimitRequests(site.directory, FakeLimits())
    for name in ("a-1.req", "a-2.ok", ".a-3.ok.tmp~x", "b-1.req", "ab-1.req"):
        (site.directory / name).write_text("x")

    class State:
        def prepare(self, claims: Any) -> Any:
            return {}

        def unprepare(self, claims: Any) -> Any:
            return {ref: None for ref in claims}

    ForgetRequestsOnUnprepare(State(), requests).unprepare(["a"])  # type: ignore[list-item]
    assert sorted(p.name for p in site.directory.iterdir()) == ["ab-1.req", "b-1.req"]


def test_stale_request_files_are_removed_at_start(site: MemoryLimitSite) -> None:
    now = [1000.0]
    requests = MemoryLimitRequests(
        site.directory, FakeLimits(), stale_seconds=30, clock=lambda: now[0]
    )
    (site.directory / "a-1.work").write_text("x")
    (site.directory / "other.txt").write_text("x")
    os.utime(site.directory / "a-1.work", (900, 900))
    os.utime(site.directory / "other.txt", (900, 900))
    requests.start()
    requests.stop()
    assert sorted(p.name for p in site.directory.iterdir()) == ["other.txt"]


def test_the_request_directory_is_under_the_data_directory(tmp_path: Path) -> None:
    assert request_dir(tmp_path) == tmp_path / "memory-limits"
    assert site_for(tmp_path, []) is None


@pytest.mark.parametrize(("version", "served"), [("615.71.09", True), ("580.95.05", False)])
def test_the_plugin_serves_requests_where_the_driver_has_the_calls(
    tmp_path: Path, version: str, served: bool
) -> None:
    for node in mps_node(tmp_path, fleet(version)):
        state = node.state(mps=False)
        with contextlib.ExitStack() as running:
            requests = serve_memory_limits(
                node.backend, node.root / "plugin", node.backend.discover(), state, running
            )
            assert (requests is not None) is served
            assert (state.context.memory_limits is not None) is served
            assert (node.root / "plugin" / "memory-limits").is_dir() is served
