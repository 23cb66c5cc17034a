"""One claim's prepare and unprepare through the plugin's own gRPC server, split into
where each millisecond goes: `python -m bench.profile_call [--cycles N] [--kubeconfig PATH]`.

The server side is the plugin's: `DeviceState` over the reference's `example` GPUs,
the claim read through `ApiClaimReader`/`KubeApi`, `DraService` on the server
`new_server` builds, logging as the daemon sets it up (text, `-v 2`, to a file) and
the metrics registry. The client is a separate process, as the kubelet is, timing each
call from the outside like bench/scenarios.py. Without `--kubeconfig` the claim comes
from a canned API server in another process (plain HTTP, keep-alive, the body a real
API server returns for the bench's claim), so the GET measures this client only; with
it, from a real API server (the bench's namespace and claim are created there).

Printed per phase, p50 / p99 over the cycles (ms):

    call        the client's wall clock around the RPC
    transport   call - handler: the kubelet's stub, the socket, gRPC's C core, the
                hand-off to a Python worker thread, protobuf parsing and serialising;
      request   from the client's send to the handler's first line (both processes
                read CLOCK_MONOTONIC), and
      response  from the handler's return to the client holding the answer
    handler     the servicer method: validation, logging, metrics, the response;
      before    its part before the state is called, and
      after     after the state returned
    state       DeviceState.prepare/unprepare (locks, journal, CDI spec), claim GET included
    claim GET   ApiClaimReader.get: the HTTP exchange and the JSON decoding
    JSON        the decoding alone (driver.config.loader.loads_json)

`--cprofile` adds the handler thread's cProfile top (the gRPC C core is invisible to it).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import gc
import multiprocessing
import multiprocessing.process
import multiprocessing.queues
import pstats
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from bench.canned_api import canned_claim, start_canned_api
from bench.profile_state import NODE, UID, Healthy, NoReports
from bench.scenarios import NS, percentile
from driver.devices.model import PoolOptions, build_pool
from driver.kube import api as kube_api
from driver.kube.api import KubeApi
from driver.kube.claims import ApiClaimReader
from driver.nvml.selection import select_backend
from driver.observability.logs import setup_logging
from driver.plugin import dra
from driver.plugin.transport.serving import new_server
from driver.proto.dra.v1 import api_pb2 as v1
from driver.proto.dra.v1 import api_pb2_grpc as v1_grpc
from driver.state.prepare import DeviceState
from driver.state.request import ClaimRef, PrepareResult

DRIVER = "gpu.example.com"
CLAIM_NAME = "profile-call"
WARM_UP = 30
Samples = dict[str, list[float]]


def run_client(
    socket: str, ref: tuple[str, str, str], cycles: int, out: multiprocessing.queues.Queue[Samples]
) -> None:
    """The kubelet's part (a child process): prepare and unprepare `cycles` times."""
    namespace, name, uid = ref
    claims = [v1.Claim(namespace=namespace, name=name, uid=uid)]
    prepare_request = v1.NodePrepareResourcesRequest(claims=claims)
    unprepare_request = v1.NodeUnprepareResourcesRequest(claims=claims)
    samples: Samples = defaultdict(list)
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = v1_grpc.DRAPluginStub(channel)
        for i in range(WARM_UP + cycles):
            t0 = time.perf_counter()
            prepared = stub.NodePrepareResources(prepare_request, timeout=30)
            t1 = time.perf_counter()
            unprepared = stub.NodeUnprepareResources(unprepare_request, timeout=30)
            t2 = time.perf_counter()
            if prepared.claims[uid].error or unprepared.claims[uid].error:
                raise SystemExit(f"cycle {i}: {prepared.claims[uid]} {unprepared.claims[uid]}")
            if i >= WARM_UP:
                # perf_counter is CLOCK_MONOTONIC: comparable with the server's marks.
                samples["prepare sent"].append(t0)
                samples["prepare received"].append(t1)
                samples["unprepare sent"].append(t1)
                samples["unprepare received"].append(t2)

    out.put(dict(samples))


class Timings:
    """Server-side moments of the one call in flight (the client calls one at a time),
    and the durations of wrapped functions."""

    def __init__(self) -> None:
        self.samples: Samples = defaultdict(list)

    def mark(self, name: str) -> None:
        self.samples[name].append(time.perf_counter())

    def between(self, what: str, call: Callable[[], Any]) -> Any:
        """`call()`, marked `<what> entered` and `<what> left`."""
        self.mark(f"{what} entered")
        try:
            return call()
        finally:
            self.mark(f"{what} left")

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.samples[name].append(time.perf_counter() - t0)

        return timed


class GcPauses:
    """Collections and their pauses per generation, from gc.callbacks."""

    def __init__(self) -> None:
        self.pauses: Samples = defaultdict(list)
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses[f"gen{info['generation']}"].append(time.perf_counter() - self._started)

    def report(self, cycles: int) -> None:
        parts = [
            f"{gen}: {len(p)} ({sum(p) * 1000:.1f} ms, max {max(p) * 1000:.2f} ms)"
            for gen, p in sorted(self.pauses.items())
        ]
        print(f"GC collections over {cycles} cycles: {'; '.join(parts) or 'none'}")


class TimedState:
    def __init__(self, state: DeviceState, timings: Timings) -> None:
        self._state = state
        self._timings = timings

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        return self._timings.between("prepare state", lambda: self._state.prepare(claims))

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, Any]:
        return self._timings.between("unprepare state", lambda: self._state.unprepare(claims))


class TimedService(dra.DraService):
    def __init__(self, state: dra.ClaimPreparer, timings: Timings, profile: bool) -> None:
        super().__init__(state)
        self._timings = timings
        self.profile = cProfile.Profile() if profile else None

    def _timed(self, what: str, call: Callable[[], Any]) -> Any:
        profile = self.profile
        if profile is not None:
            return self._timings.between(what, lambda: profile.runcall(call))
        return self._timings.between(what, call)

    def prepare(self, request: Any, context: grpc.ServicerContext, pb: Any) -> Any:
        return self._timed(
            "prepare", lambda: super(TimedService, self).prepare(request, context, pb)
        )

    def unprepare(self, request: Any, context: grpc.ServicerContext, pb: Any) -> Any:
        return self._timed(
            "unprepare", lambda: super(TimedService, self).unprepare(request, context, pb)
        )


def serve(service: dra.DraService, socket: Path) -> Callable[[], None]:
    """The service on the server the plugin builds; returns how to stop it."""
    server = new_server(max_workers=16)
    v1_grpc.add_DRAPluginServicer_to_server(dra.V1Servicer(service), server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return lambda: server.stop(0).wait()


def serve_aio(service: dra.DraService, socket: Path) -> Callable[[], None]:
    """The service on a grpc.aio server whose handlers call it on the event loop thread
    (no hand-off to a worker; blocking the loop is fine for one call at a time)."""

    class AioServicer(v1_grpc.DRAPluginServicer):
        async def NodePrepareResources(self, request: Any, context: Any) -> Any:
            return service.prepare(request, context, v1)

        async def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
            return service.unprepare(request, context, v1)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="aio-server", daemon=True)
    thread.start()

    async def start() -> grpc.aio.Server:
        server = grpc.aio.server()  # on the loop's thread: it binds to the running loop
        v1_grpc.add_DRAPluginServicer_to_server(AioServicer(), server)
        server.add_insecure_port(f"unix://{socket}")
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return stop


def claim_source(
    kubeconfig: Path | None, uid: str, work: Path
) -> tuple[KubeApi, tuple[str, str, str]]:
    """The API the plugin reads the claim from, and the claim (namespace, name, uid)."""
    if kubeconfig is None:
        kubeconfig = start_canned_api(canned_claim(NS, CLAIM_NAME, uid, NODE), work)
        return KubeApi.from_kubeconfig(str(kubeconfig)), (NS, CLAIM_NAME, uid)
    from bench.cluster import Api
    from bench.scenarios import allocated_claim, setup_namespace

    admin = Api(kubeconfig)
    setup_namespace(admin)
    created = allocated_claim(admin, NODE, CLAIM_NAME, "gpu-0")
    return KubeApi.from_kubeconfig(str(kubeconfig)), (created.namespace, created.name, created.uid)


def report(samples: Samples) -> None:
    def stats(values: list[float]) -> str:
        ordered = sorted(values)
        p50 = percentile(ordered, 50) * 1000
        p99 = percentile(ordered, 99) * 1000
        return f"{p50:7.3f} / {p99:7.3f}"

    def minus(later: str, earlier: str) -> list[float]:
        return [b - a for a, b in zip(samples[earlier], samples[later], strict=True)]

    for what in ("prepare", "unprepare"):
        rows = {
            "call": minus(f"{what} received", f"{what} sent"),
            "transport": [
                a + b
                for a, b in zip(
                    minus(f"{what} entered", f"{what} sent"),
                    minus(f"{what} received", f"{what} left"),
                    strict=True,
                )
            ],
            "  request": minus(f"{what} entered", f"{what} sent"),
            "  response": minus(f"{what} received", f"{what} left"),
            "handler": minus(f"{what} left", f"{what} entered"),
            "  before": minus(f"{what} state entered", f"{what} entered"),
            "  after": minus(f"{what} left", f"{what} state left"),
            "state": minus(f"{what} state left", f"{what} state entered"),
        }
        if what == "prepare":
            rows["claim GET"] = samples["claim GET"]
            rows["JSON"] = samples["JSON"]
        print(f"{what} ({len(rows['call'])} calls), ms p50 / p99:")
        for name, values in rows.items():
            print(f"  {name:<10} {stats(values)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.profile_call",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cycles", type=int, default=300)
    p.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="disk under test")
    p.add_argument("--kubeconfig", type=Path, help="read the claim from this API server")
    p.add_argument("--cprofile", action="store_true", help="print the handler's cProfile top")
    p.add_argument("--log", type=Path, help="the plugin's log (default: a file beside its state)")
    p.add_argument(
        "--server",
        choices=("plugin", "aio"),
        default="plugin",
        help="plugin: the plugin's server (new_server); aio: a grpc.aio server calling the "
        "same service on its event loop (an experiment: the best case for asyncio)",
    )
    args = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="gpu-dra-profile-", dir=args.dir))
    try:
        samples, gc_pauses, service = measure(args, root)
    finally:
        shutil.rmtree(root)
    print(f"{args.cycles} cycles, claim from {args.kubeconfig or 'a canned API server'}")
    report(samples)
    gc_pauses.report(WARM_UP + args.cycles)
    if service.profile is not None:
        pstats.Stats(service.profile).sort_stats("tottime").print_stats(25)
    return 0


def measure(args: argparse.Namespace, root: Path) -> tuple[Samples, GcPauses, TimedService]:
    """Serve from `root`, run the client, return the server's and the client's samples."""
    stderr, sys.stderr = sys.stderr, (args.log or root / "plugin.log").open("a")
    try:
        setup_logging("text", 2)  # the daemon's default: the per-call info lines are written
    finally:
        sys.stderr = stderr
    timings = Timings()
    kube_api.loads_json = timings.wrap("JSON", kube_api.loads_json)
    ApiClaimReader.get = timings.wrap("claim GET", ApiClaimReader.get)  # type: ignore[method-assign]
    api, ref = claim_source(args.kubeconfig, UID, root)
    inventory = select_backend(mock=True, fleet_path="example", node_name=NODE).discover()
    state = DeviceState(
        driver_name=DRIVER,
        node_name=NODE,
        devices={d.name: d for d in build_pool(inventory, PoolOptions()).devices},
        cdi_root=root / "cdi",
        data_dir=root / "plugin",
        claims=ApiClaimReader(api),
        health=Healthy(),
        reporter=NoReports(),
    )
    service = TimedService(TimedState(state, timings), timings, args.cprofile)
    socket = root / "dra.sock"
    stop_server = serve_aio(service, socket) if args.server == "aio" else serve(service, socket)
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.queues.Queue[Samples] = ctx.Queue()
    client = ctx.Process(target=run_client, args=(str(socket), ref, args.cycles, out))
    gc_pauses = GcPauses()
    gc.callbacks.append(gc_pauses)
    try:
        client.start()
        client_samples = _collect(client, out)
        client.join()
    finally:
        gc.callbacks.remove(gc_pauses)
        stop_server()
    # One mark of each kind per call: the last `cycles` are the client's recorded calls.
    server_samples = {k: v[-args.cycles :] for k, v in timings.samples.items()}
    return {**server_samples, **client_samples}, gc_pauses, service


def _collect(
    client: multiprocessing.process.BaseProcess, out: multiprocessing.queues.Queue[Samples]
) -> Samples:
    while True:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            if not client.is_alive():
                raise SystemExit(f"the client exited with {client.exitcode}") from None


if __name__ == "__main__":
    raise SystemExit(main())
