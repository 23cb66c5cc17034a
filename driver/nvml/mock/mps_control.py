"""The mock driver root's `nvidia-cuda-mps-control` (installed there by
`install_mps_control`): a stand-in for NVIDIA's MPS control daemon at the level this
driver uses it (driver/nvml/mps.py), with no GPU behind it.

- `-d` daemonizes (double fork, own session), opens the control socket
  `$CUDA_MPS_PIPE_DIRECTORY/control`, writes `nvidia-cuda-mps-control.pid` there and
  logs to `$CUDA_MPS_LOG_DIRECTORY/control.log`; the command returns once the daemon
  answers. A second `-d` on a pipe directory whose daemon runs fails, as the real one
  does ("An instance of this daemon is already running"). `-d -M` is the same daemon
  in multi-user mode (NVIDIA's `multiUser`): its log says so.
- Without arguments it is the client: each line of stdin is sent to the daemon and its
  answer printed; no daemon: "Cannot find MPS control daemon process", status 1.
- The daemon answers `set_default_active_thread_percentage <1..100>`,
  `get_default_active_thread_percentage`, `set_default_device_pinned_mem_limit <dev>
  <n>M|<n>G` (dev an index of its CUDA_VISIBLE_DEVICES),
  `get_default_device_pinned_mem_limit <dev>`, `get_server_list` (empty: no clients
  ever connect) and `quit [-t <seconds>]` (removes its pid file and socket and exits:
  it has no clients to wait for); anything else is refused. Every command is logged,
  so the log records what it was told.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path
from typing import Final

BINARY: Final = "nvidia-cuda-mps-control"
PID_FILE: Final = "nvidia-cuda-mps-control.pid"
SOCKET: Final = "control"
_LIMIT: Final = re.compile(r"^[1-9][0-9]*[MG]$")


def install_mps_control(driver_root: Path) -> Path:
    """Put the stand-in at `<driver_root>/usr/bin/nvidia-cuda-mps-control`: a shell
    script running this module with this interpreter and this package."""
    path = driver_root / "usr" / "bin" / BINARY
    package_root = Path(__file__).resolve().parents[3]
    script = (
        "#!/bin/sh\n"
        f"PYTHONPATH='{package_root}'${{PYTHONPATH:+:$PYTHONPATH}} "
        f"exec '{sys.executable}' -m driver.nvml.mock.mps_control \"$@\"\n"
    )
    if not path.is_file() or path.read_text() != script:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{BINARY}.{os.getpid()}")
        temp.write_text(script)
        temp.chmod(0o755)
        temp.replace(path)
    return path


def _dirs() -> tuple[Path, Path]:
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    logs = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    return pipe, logs


def _ask(pipe: Path, line: str) -> str | None:
    """The daemon's answer to one line, None if no daemon listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(str(pipe / SOCKET))
        except OSError:
            return None
        conn.sendall(line.encode() + b"\n")
        conn.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := conn.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode()


class _Daemon:
    def __init__(self, pipe: Path, logs: Path, devices: int) -> None:
        self.pipe, self.logs, self.devices = pipe, logs, devices
        self.threads = 100
        self.limits: dict[int, str] = {}

    def log(self, text: str) -> None:
        with open(self.logs / "control.log", "a") as out:
            out.write(f"[mock] Control: {text}\n")

    def answer(self, line: str) -> tuple[str, bool]:
        """(answer, quit)."""
        self.log(f"command {line!r}")
        words = line.split()
        name, args = (words[0], words[1:]) if words else ("", [])
        timeout = len(args) == 2 and args[0] == "-t" and args[1].isdigit()
        if name == "quit" and (not args or timeout):
            return "", True
        if name == "get_server_list" and not args:
            return "", False
        if name == "get_default_active_thread_percentage" and not args:
            return f"{self.threads:.1f}", False
        if name == "set_default_active_thread_percentage" and len(args) == 1:
            if not args[0].isdigit() or not 1 <= int(args[0]) <= 100:
                return f"Invalid percentage {args[0]}", False
            self.threads = int(args[0])
            return f"{self.threads:.1f}", False
        if name in ("get_default_device_pinned_mem_limit", "set_default_device_pinned_mem_limit"):
            setting = name.startswith("set")
            if len(args) != (2 if setting else 1):
                return f"Invalid arguments to {name}", False
            if not args[0].isdigit() or int(args[0]) >= self.devices:
                return f"Invalid device {args[0]}", False
            device = int(args[0])
            if setting:
                if not _LIMIT.match(args[1]):
                    return f"Invalid limit {args[1]}", False
                self.limits[device] = args[1]
            return self.limits.get(device, "0M"), False
        return f"Invalid command {line!r}", False

    def serve(self, server: socket.socket) -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                data = b""
                while chunk := conn.recv(4096):
                    data += chunk
                replies, stop = [], False
                for line in data.decode().splitlines():
                    if line.strip():
                        reply, stop = self.answer(line.strip())
                        replies.append(reply)
                        if stop:
                            break
                conn.sendall("".join(r + "\n" for r in replies if r).encode())
            if stop:
                self.log("exiting")
                (self.pipe / PID_FILE).unlink(missing_ok=True)
                (self.pipe / SOCKET).unlink(missing_ok=True)
                return


def _daemonize(pipe: Path, logs: Path, *, multi_user: bool = False) -> int:
    if _ask(pipe, "get_server_list") is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    (pipe / SOCKET).unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(pipe / SOCKET))
    server.listen(8)
    ready_read, ready_write = os.pipe()
    if os.fork() > 0:  # the caller's process: returns once the daemon is ready
        os.close(ready_write)
        ok = os.read(ready_read, 1) == b"1"
        return 0 if ok else 1
    os.close(ready_read)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    daemon = _Daemon(pipe, logs, devices=max(len(visible), 1))
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")
    mode = " in multi-user mode" if multi_user else ""
    daemon.log(f"daemon started{mode} for CUDA_VISIBLE_DEVICES={','.join(visible)}")
    os.write(ready_write, b"1")
    os.close(ready_write)
    daemon.serve(server)
    os._exit(0)


def main(argv: list[str]) -> int:
    pipe, logs = _dirs()
    if argv in (["-d"], ["-d", "-M"]):
        return _daemonize(pipe, logs, multi_user="-M" in argv)
    if argv:
        print(f"{BINARY} (mock): unsupported arguments {' '.join(argv)}", file=sys.stderr)
        return 2
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = _ask(pipe, line.strip())
        if reply is None:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        sys.stdout.write(reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
