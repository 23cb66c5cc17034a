"""Socket paths, including the rolling-update names keyed by the pod UID."""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

SUN_PATH_MAX = 107  # AF_UNIX sun_path holds 108 bytes including the terminating NUL


@dataclass(frozen=True)
class SocketPaths:
    registration: Path
    service: Path


def _short_hash(data: bytes, length: int) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")
    return digest[:length]


def socket_paths(
    driver_name: str, registrar_dir: Path, plugin_dir: Path, pod_uid: str | None
) -> SocketPaths:
    """Chooses names like the Go kubelet-plugin helper does.

    Without a pod UID the names are fixed (one instance per node). With one, each pod
    gets its own sockets so a new instance can register before the old one leaves; the
    registration name is shortened step by step until it fits in sun_path.
    """
    if not pod_uid:
        fixed = SocketPaths(registrar_dir / f"{driver_name}-reg.sock", plugin_dir / "dra.sock")
        for path, flag in (
            (fixed.registration, "--kubelet-registrar-directory-path"),
            (fixed.service, "--kubelet-plugins-directory-path"),
        ):
            if len(os.fsencode(path)) > SUN_PATH_MAX:
                raise ValueError(
                    f"{flag}: socket path {path} is longer than {SUN_PATH_MAX} bytes "
                    "(the unix socket limit); use a shorter directory"
                )
        return fixed
    instance_key = driver_name.encode() + b"\0" + pod_uid.encode()
    candidates = (
        f"{driver_name}-{pod_uid}-reg.sock",
        f"{driver_name}-{_short_hash(pod_uid.encode(), 11)}-reg.sock",
        f"dra-{_short_hash(instance_key, 22)}-reg.sock",
    )
    registration = next(
        (
            registrar_dir / c
            for c in candidates
            if len(os.fsencode(registrar_dir / c)) <= SUN_PATH_MAX
        ),
        registrar_dir / candidates[-1],
    )
    service = plugin_dir / f"dra-{pod_uid}.sock"
    if len(os.fsencode(service)) > SUN_PATH_MAX:
        service = plugin_dir / f"dra-{_short_hash(pod_uid.encode(), 22)}.sock"
    return SocketPaths(registration, service)
