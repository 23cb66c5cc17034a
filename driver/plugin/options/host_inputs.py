"""Flag values that become paths on the host, checked before anything touches it.

The driver name is a path component (the data dir `<plugins dir>/<driver>`, the CDI
spec names `k8s.<driver>-gpu_*.json`, the socket names): it must be a DNS subdomain
(lower-case RFC 1123) of at most 63 characters, as the API requires of a DRA driver
name, so that `../../tmp/evil` never puts the data dir or the common CDI spec outside
their directories.

A directory the plugin writes into (CDI root, kubelet plugin and registration
directories, the mock driver root) must be absolute and normalised (no `..`
component, no leading `//`), not `/` or a top-level system directory (`/etc`,
`/usr`, ...), and not inside `/proc`, `/sys`, `/dev` or `/boot`. A path it only
reads or names (the NVIDIA driver root, which may be `/`; the host path of
nvidia-cdi-hook) must be absolute and normalised. The chart's values.schema.json
applies the same rules to the same values.
"""

from __future__ import annotations

import argparse
import re
from pathlib import PurePosixPath
from typing import Final

# resource.k8s.io's DriverNameMaxLength: a DNS subdomain, at most 63 characters.
DRIVER_NAME_MAX: Final = 63
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")

# Directories the driver must never write into directly.
SYSTEM_DIRS: Final = frozenset(
    {"/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32"}
    | {"/proc", "/root", "/run", "/sbin", "/sys", "/usr", "/var"}
)
# Trees where nothing of the driver belongs (pseudo file systems, the boot loader's).
SYSTEM_TREES: Final = ("/proc", "/sys", "/dev", "/boot")


def check_driver_name(value: str) -> str:
    """`value` if it is a DNS subdomain, else ValueError saying why."""
    if len(value) > DRIVER_NAME_MAX:
        raise ValueError(f"{value[:40]!r}... is longer than {DRIVER_NAME_MAX} characters")
    if not _DNS_SUBDOMAIN.match(value):
        raise ValueError(
            f"{value!r} is not a DNS subdomain (lower-case letters, digits, '-' and '.', "
            "e.g. gpu.example.com)"
        )
    return value


def driver_name_argument(value: str) -> str:
    """argparse `type` of `--driver-name` (the CLI's and the webhook's)."""
    try:
        return check_driver_name(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check_path(value: str | PurePosixPath, *, written: bool) -> None:
    """ValueError unless the path is absolute and normalised; a `written` one also
    must not be `/`, a top-level system directory or inside a pseudo file system."""
    text = str(value)
    if not text.startswith("/"):
        raise ValueError(f"{text!r} is not an absolute path")
    if text.startswith("//") or ".." in PurePosixPath(text).parts:
        raise ValueError(f"{text!r} is not normalised (no '..' component, no leading '//')")
    if not written:
        return
    normal = str(PurePosixPath(text))  # without a trailing '/' or '.' components
    if normal in SYSTEM_DIRS or any(normal.startswith(f"{tree}/") for tree in SYSTEM_TREES):
        raise ValueError(
            f"{text!r} is a system directory; the plugin writes there: give a directory "
            "of its own (e.g. /var/run/cdi, /var/lib/kubelet/plugins)"
        )
