"""gpu-dra-mps-daemon: the main process of an MPS daemon's pod (--mps-daemons=
kubernetes; driver/kube/mps_manifest.py, docs/mps.md).

It starts `nvidia-cuda-mps-control -d` from the driver root for one GPU (`-d -M`,
multi-user, for a GPU's shared server: `--multi-user`), tells it
the limits through the control pipe and reads them back, then writes the
startup-complete file that the pod's startup probe waits for (the plugin's prepare
waits for the pod to be ready). It then watches the daemon: a daemon that dies ends
this process with status 1, and the kubelet restarts the container (the Deployment
keeps it on the node); SIGTERM (the Deployment deleted at unprepare) quits the daemon
and waits until it is gone.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from driver.config.mps_limits import MAX_ACTIVE_THREAD_PERCENTAGE, MIB
from driver.errors import DriverError
from driver.nvml.mps import DaemonDirs, MpsControl, is_running
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemons import configure_limits

log = logging.getLogger("gpu-dra-mps-daemon")
WATCH_INTERVAL = 1.0


def _percentage(text: str) -> int:
    value = int(text)
    if not 1 <= value <= MAX_ACTIVE_THREAD_PERCENTAGE:
        raise argparse.ArgumentTypeError(f"must be between 1 and 100, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-dra-mps-daemon", description=__doc__.split("\n")[0])
    parser.add_argument("--driver-root", type=Path, required=True)
    parser.add_argument("--pipe-directory", type=Path, required=True)
    parser.add_argument("--log-directory", type=Path, required=True)
    parser.add_argument("--gpu", required=True, help="the GPU's UUID")
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--active-thread-percentage", type=_percentage)
    parser.add_argument("--pinned-memory-mib", type=_positive)
    parser.add_argument("--multi-user", action="store_true", help="the GPU's shared server")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    memory = args.pinned_memory_mib * MIB if args.pinned_memory_mib else None
    record = MpsRecord(args.gpu, "pod", args.active_thread_percentage, memory)
    control = MpsControl(args.driver_root)
    dirs = DaemonDirs(args.pipe_directory, args.log_directory)
    stopping = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        control.stop(dirs, control.running(dirs))  # one left by an earlier container
        daemon = control.start(dirs, [args.gpu], multi_user=args.multi_user)
        try:
            configure_limits(control, dirs, record)
        except DriverError:
            control.stop(dirs, daemon)
            raise
        args.ready_file.parent.mkdir(parents=True, exist_ok=True)
        args.ready_file.write_text(f"{daemon.pid}\n")
        log.info(
            "MPS control daemon %d for GPU %s holds active threads %s%%, pinned memory %s",
            daemon.pid,
            args.gpu,
            args.active_thread_percentage or "100",
            f"{args.pinned_memory_mib}MiB" if memory else "unlimited",
        )
        while not stopping.wait(WATCH_INTERVAL):
            if not is_running(daemon):
                log.error("the MPS control daemon %d is gone", daemon.pid)
                args.ready_file.unlink(missing_ok=True)
                return 1
        args.ready_file.unlink(missing_ok=True)
        control.stop(dirs, daemon)
    except DriverError as err:
        print(f"gpu-dra-mps-daemon: {err}", file=sys.stderr)
        return 1
    log.info("MPS control daemon %d quit", daemon.pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
