"""`gpu-dra mock xid|lost|reset|recovery-action|process`: inject health events, or
processes, into a running mock plugin.

Works only against a kubelet plugin started with the mock NVML backend. The request
goes to the plugin's status socket (`POST /control/<action>` on
`<state-dir>/status.sock`, root only; `--socket`); the plugin injects it into its mock
NVML, where it takes the same path as a real event (classification, taint, health
stream). Run it inside the plugin's pod:

    kubectl exec -n <ns> <plugin-pod> -- gpu-dra mock xid --device gpu-3 --xid 79
    kubectl exec -n <ns> <plugin-pod> -- gpu-dra mock xid --device gpu-0-mig-1g10gb-3 \
        --xid 94 --instance
    kubectl exec -n <ns> <plugin-pod> -- gpu-dra mock lost --device gpu-0-mig-1g10gb-0
    kubectl exec -n <ns> <plugin-pod> -- gpu-dra mock reset --all
    kubectl exec -n <ns> <plugin-pod> -- gpu-dra mock recovery-action --device gpu-3 \
        --action drain-and-reset
    kubectl exec -n <ns> <plugin-pod> -- gpu-dra mock process --device gpu-0 \
        --memory-mib 512 --pod-uid <uid>
    kubectl exec -n <ns> <plugin-pod> -- gpu-dra mock process --end <pid>

A partition name means its GPU, unless `xid --instance` attributes the Xid to the
partition's live MIG GPU instance (as NVML does for an Xid inside a partition): then
only the devices on its memory slices are tainted. A dynamic partition has a GPU
instance only while it is prepared. `reset` clears the GPU and all its partitions.
`recovery-action` sets the NVML recovery action of a device's GPU, which the plugin
reads at its next poll (`none` takes it back; an Xid that needs a reset, e.g. 48,
sets `gpu-reset` by itself, and `reset` sets `none`). `process` starts a compute
process on a device's GPU as NVML lists it (`--kind mps-client`: an MPS client; a
`--pod-uid` puts it in that pod's cgroup), prints its pid, and `--end` ends it: no CUDA
runs on a mock GPU, so this is how a demo or a test shows an MPS escape (docs/mps.md).
Exit codes: 0 injected, 1 refused, or no plugin on the mock backend answers, 2 usage
error.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from driver.cli.arguments import add_command, positive_seconds
from driver.cli.output import std_streams
from driver.cli.plugin_endpoint import (
    ControlRefused,
    PluginUnreachable,
    add_socket_argument,
    post_control,
    socket_path,
)
from driver.cli.state_dir import STATE_DIR_ENV, default_state_dir
from driver.nvml.recovery_action import ACTION_NAMES, parse_action

if TYPE_CHECKING:  # the mock's own modules: imported by `run` only
    from driver.nvml.mock.mock_control import MockRequest

RECOVERY_ACTION = "recovery-action"
PROCESS = "process"


class MockSubmitError(Exception):
    """The request was not injected: the message says why."""


def _xid(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an Xid: {text!r}") from None
    if not 0 < value <= 0xFFFFFFFF:
        raise argparse.ArgumentTypeError(f"Xid {value} is out of range (1..4294967295)")
    return value


def _recovery_action(text: str) -> int:
    try:
        return parse_action(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        default=str(default_state_dir()),
        help=f"the plugin's data directory (default: ${STATE_DIR_ENV} or %(default)s)",
    )
    add_socket_argument(parser)
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=5.0,
        help=(
            "seconds the plugin has to take the request, else it is withdrawn "
            "(default: %(default)s)"
        ),
    )


HELP = "inject health events (Xid, GPU lost, reset, recovery action) into a running mock plugin"


def add_parser(subcommands: Any) -> None:
    parser = add_command(subcommands, "mock", __doc__, HELP)
    actions = parser.add_subparsers(dest="mock_action", required=True, metavar="ACTION")

    xid = actions.add_parser("xid", help="report an Xid error on a device's GPU")
    xid.add_argument("--device", required=True, help="gpu-<n>, a partition name, or a GPU UUID")
    xid.add_argument("--xid", required=True, type=_xid, help="the Xid number, e.g. 79")
    xid.add_argument(
        "--instance",
        action="store_true",
        help=(
            "attribute the Xid to the device's live MIG GPU instance (a prepared "
            "partition, or a static MIG device) instead of its whole GPU"
        ),
    )
    _common(xid)
    xid.set_defaults(run=run)

    lost = actions.add_parser("lost", help="make a device's GPU fall off the bus (GPU is lost)")
    lost.add_argument("--device", required=True, help="gpu-<n>, a partition name, or a GPU UUID")
    _common(lost)
    lost.set_defaults(run=run)

    reset = actions.add_parser("reset", help="reset a GPU (or all): clears its health taints")
    target = reset.add_mutually_exclusive_group(required=True)
    target.add_argument("--device", help="gpu-<n>, a partition name, or a GPU UUID")
    target.add_argument("--all", action="store_true", help="reset every GPU of the node")
    _common(reset)
    reset.set_defaults(run=run)

    recovery = actions.add_parser(
        RECOVERY_ACTION, help="set the NVML recovery action of a device's GPU (none: clear it)"
    )
    recovery.add_argument(
        "--device", required=True, help="gpu-<n>, a partition name, or a GPU UUID"
    )
    recovery.add_argument(
        "--action",
        required=True,
        dest="recovery_action",
        type=_recovery_action,
        metavar="ACTION",
        help=f"{', '.join(ACTION_NAMES.values())}, or NVML's number",
    )
    _common(recovery)
    recovery.set_defaults(run=run)

    process = actions.add_parser(
        PROCESS, help="start a compute process on a device's GPU (or --end one), as NVML lists it"
    )
    which = process.add_mutually_exclusive_group(required=True)
    which.add_argument("--device", help="gpu-<n>, a partition name, or a GPU UUID")
    which.add_argument("--end", type=int, metavar="PID", help="end the mock process PID")
    process.add_argument(
        "--kind",
        choices=("compute", "mps-client"),
        default="compute",
        help="outside MPS (compute) or an MPS client (default: %(default)s)",
    )
    process.add_argument("--memory-mib", type=int, default=0, help="GPU memory it uses")
    process.add_argument("--pod-uid", help="the pod whose cgroup it runs in")
    _common(process)
    process.set_defaults(run=run_process)


def request_from_args(args: argparse.Namespace) -> MockRequest:
    from driver.nvml.mock.mock_control import MockRequest

    return MockRequest(
        action=args.mock_action,
        device=args.device,
        xid=getattr(args, "xid", None),
        all=bool(getattr(args, "all", False)),
        instance=bool(getattr(args, "instance", False)),
        recovery_action=getattr(args, "recovery_action", None),
    )


def submit(
    state_dir: str | Path,
    request: MockRequest,
    *,
    timeout: float = 5.0,
    socket: Path | None = None,
) -> str:
    """Deliver `request` to the running plugin's status socket (`socket`, else the one
    in `state_dir`) and return its answer. Raises MockSubmitError."""
    from driver.nvml.mock.mock_control import MockControlError

    try:
        request.validate()
    except MockControlError as err:
        raise MockSubmitError(str(err)) from None
    path = socket_path(socket, Path(state_dir))
    try:
        answer = post_control(path, request.action, request.to_document(), timeout=timeout)
    except PluginUnreachable as err:
        raise MockSubmitError(f"no kubelet plugin answers: {err}") from None
    except ControlRefused as err:
        if err.status == 404 and "actions" in err.answer:  # a plugin on real NVML
            raise MockSubmitError(
                f"the running plugin does not accept {request.action!r} (a mock NVML "
                f"action): it accepts: {', '.join(err.answer['actions']) or 'none'}"
            ) from None
        raise MockSubmitError(f"the plugin refused the request: {err}") from None
    message = str(answer.get("message", ""))
    if request.instance and "instance" not in answer:
        raise MockSubmitError(
            f"the plugin predates --instance: it injected the Xid for the whole GPU ({message})"
        )
    return message


@std_streams
def run(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    try:
        message = submit(
            args.state_dir, request_from_args(args), timeout=args.timeout, socket=args.socket
        )
    except MockSubmitError as error:
        print(f"gpu-dra mock {args.mock_action}: {error}", file=err)
        return 1
    print(f"injected: {message}", file=out)
    return 0


def process_document(args: argparse.Namespace) -> dict[str, Any]:
    """The `process` action's request (validated by the plugin's mock)."""
    if args.end is not None:
        return {"end": args.end}
    doc: dict[str, Any] = {"device": args.device, "kind": args.kind, "memoryMiB": args.memory_mib}
    if args.pod_uid:
        doc["podUID"] = args.pod_uid
    return doc


@std_streams
def run_process(args: argparse.Namespace, out: TextIO, err: TextIO, stdin: TextIO) -> int:
    path = socket_path(args.socket, Path(args.state_dir))
    try:
        answer = post_control(path, PROCESS, process_document(args), timeout=args.timeout)
    except PluginUnreachable as error:
        print(f"gpu-dra mock process: no kubelet plugin answers: {error}", file=err)
        return 1
    except ControlRefused as error:
        print(f"gpu-dra mock process: the plugin refused the request: {error}", file=err)
        return 1
    print(f"{answer.get('message', '')}", file=out)
    return 0
