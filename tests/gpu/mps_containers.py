"""Containers of claims' MPS shares (tests/gpu/mps_shares.py), each started with
exactly its claim's CDI edits (tests/cdi_bundle.py) over a root filesystem of its own,
running the CUDA client tests/gpu/cuda_bound.py in lock-step with the caller
(tests/gpu/bound_clients.py): tests/gpu/test_mps_containers.py on a GPU, and
tests/integration/test_mps_containers_mock.py on the mock with a stand-in libcuda."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from driver.nvml.mps import DaemonId, MpsControl
from tests import cdi_bundle
from tests.gpu import containers
from tests.gpu.bound_clients import BoundReport, Client, context_memory, finish, reach, release
from tests.gpu.cuda_bound import HOLDING, READY
from tests.gpu.mps_shares import PreparedShare, running_ids
from tests.gpu.node import GpuNode

PROGRAM = Path(__file__).with_name("cuda_bound.py")
MARGIN_MIB = 64


def python_rootfs(rootfs: Path, driver_libraries: Sequence[Path]) -> list[str]:
    """This host's Python with cuda_bound and the C libraries the driver's libraries
    (which the CDI edits mount) link; the argv that runs it."""
    return containers.python_rootfs(rootfs, PROGRAM, driver_libraries)


def mps_servers(control: MpsControl) -> Callable[[PreparedShare], list[int]]:
    """The pids of the MPS servers of a share's daemon (`get_server_list`)."""

    def servers(share: PreparedShare) -> list[int]:
        answer = control.command(share.dirs, "get_server_list")
        return [int(word) for word in answer.split() if word.isdigit()]

    return servers


@dataclass(frozen=True)
class LockstepRun:
    bounds: list[int]  # MiB each context reported free, the shares' order
    reports: list[BoundReport]
    servers: list[DaemonId]  # the MPS servers that ran while both held memory


def _specs(node: GpuNode, share: PreparedShare) -> list[dict[str, Any]]:
    """The specs a CDI runtime reads for the share's devices: its claim's and the
    common one."""
    common = json.loads(node.state.cdi.common_spec_path.read_text())
    return [node.spec(share.share.uid), common]


def _start(
    stack: ExitStack,
    node: GpuNode,
    share: PreparedShare,
    tmp: Path,
    rootfs: Callable[[Path, Sequence[Path]], list[str]],
) -> Client:
    base = tmp / share.share.uid
    specs = _specs(node, share)
    argv = [*rootfs(base / "rootfs", containers.driver_libraries(specs)), str(MARGIN_MIB)]
    started = cdi_bundle.started(base / "bundle", base / "rootfs", specs, share.cdi_devices, argv)
    return Client(share.share.uid, stack.enter_context(started))


def _under_its_limit(client: Client, node: GpuNode, share: PreparedShare) -> int:
    """The bound its context reports; AssertionError, before anything is allocated,
    when it is not under the claim's pinned limit (not a client of the claim's MPS
    server: the GPU's own memory would be free), naming what the claim mounts."""
    edits = cdi_bundle.edits_for(_specs(node, share), share.cdi_devices)
    mounts = sorted({m["containerPath"] for e in edits for m in e.get("mounts", [])})
    free, total = context_memory(client.lines)
    print(f"{client.name}: limit {share.share.memory_mib} MiB, context free {free} of {total}")
    assert 0 < free < share.share.memory_mib, (
        f"{client.name}: its context reports {free} MiB free of {total}, not under its "
        f"claim's pinned limit of {share.share.memory_mib} MiB: not a client of the "
        f"claim's MPS server; the claim's edits mount {mounts} in the container; it "
        f"said:\n{client.said()}"
    )
    return free


def in_lockstep(
    node: GpuNode,
    prepared: Sequence[PreparedShare],
    tmp: Path,
    *,
    servers: Callable[[PreparedShare], list[int]],
    rootfs: Callable[[Path, Sequence[Path]], list[str]] = python_rootfs,
) -> LockstepRun:
    """A container per share, all running at once: every context exists before any
    allocates (each bound checked under its claim's limit first), and every container
    holds its allocation while each share's daemon is asked for its MPS `servers`
    (one of its own each). The containers are gone on return."""
    running: list[DaemonId] = []
    with ExitStack() as stack:
        clients = [_start(stack, node, p, tmp, rootfs) for p in prepared]
        reach(clients, READY)
        bounds = [_under_its_limit(c, node, p) for c, p in zip(clients, prepared, strict=True)]
        release(clients)
        reach(clients, HOLDING)
        for share in prepared:
            pids = servers(share)
            print(f"{share.share.uid}: MPS servers {pids}")
            assert pids, f"{share.share.uid}: no MPS server while its client holds memory"
            running += running_ids(pids)
        assert len({s.pid for s in running}) == len(running) >= len(prepared), running
        release(clients)
        assert finish(clients) == [0] * len(clients), "\n".join(c.said() for c in clients)
        for client in clients:
            print(f"{client.name}:\n{client.said()}")
        return LockstepRun(bounds, [c.report() for c in clients], running)
