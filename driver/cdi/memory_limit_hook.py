"""The CDI edit that holds a container to its claim's memory share: a `createRuntime`
hook that hands the container's pid to the plugin, which sets the hard limit on the
container's cgroup (NVML R615 and later; docs/mps.md, "Memory limits the kernel driver
keeps", has the design and the protocol).

The runtime runs the hook on the host, where only `/bin/sh` and the basic utilities
(`cat`, `mv`, `rm`, `sleep`, `date`) can be assumed, so the hook is a short script: it
writes `<gpu UUID> <bytes>` and the OCI state (the container's host `pid`) to
`<dir>/<claim>-<n>.tmp` (umask 077), renames it to `<claim>-<n>.req`, waits at most
`wait` seconds for the plugin's `<claim>-<n>.ok` or `.err`
(driver/plugin/memory_limit_requests.py), removes its files and exits 0 on `.ok`, else
1: the runtime then fails the container's creation, so a container never runs without
its limit. `<dir>` is `<data dir>/memory-limits` (0700, root's; the data directory has
one path on the host and in the plugin's container). The CDI hook's `timeout` is
`wait` + `TIMEOUT_MARGIN_SECONDS`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from driver.cdi.claim_specs import CdiHook
from driver.devices.formatting import parse_quantity

REQUEST_DIR_NAME: Final = "memory-limits"
REQUEST_DIR_MODE: Final = 0o700
DEFAULT_WAIT_SECONDS: Final = 10
TIMEOUT_MARGIN_SECONDS: Final = 5
HOOK_PATH: Final = "/bin/sh"
HOOK_ARG0: Final = "gpu-memory-limit"  # $0 of the script: its name in the runtime's errors

# $1 directory, $2 claim (file name prefix), $3 GPU UUID, $4 bytes, $5 wait (seconds).
# `sleep 0.05` where the host's sleep takes fractions (coreutils, busybox), else 1 s.
HOOK_SCRIPT: Final = """set -u
r="$1/$2-$$-$(date +%s%N 2>/dev/null || date +%s)"
umask 077
{ printf '%s %s\\n' "$3" "$4"; cat; } >"$r.tmp" && mv -f "$r.tmp" "$r.req" || {
  rm -f "$r.tmp"; echo "$0: cannot write a request in $1" >&2; exit 1; }
end=$(( $(date +%s) + $5 ))
while [ ! -e "$r.ok" ] && [ ! -e "$r.err" ]; do
  if [ "$(date +%s)" -ge "$end" ]; then
    rm -f "$r".*
    echo "$0: the GPU plugin did not set the memory limit of $2 on $3 within $5s" >&2
    exit 1
  fi
  sleep 0.05 2>/dev/null || sleep 1
done
if [ -e "$r.ok" ]; then rm -f "$r".*; exit 0; fi
echo "$0: $(cat "$r.err")" >&2
rm -f "$r".*
exit 1
"""

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def request_prefix(claim_uid: str) -> str:
    """The claim's part of its request files' names (a UID is safe as it is)."""
    return _UNSAFE.sub("_", claim_uid)


def request_dir(data_dir: Path | str) -> Path:
    return Path(data_dir) / REQUEST_DIR_NAME


def memory_share_bytes(
    *,
    pinned_memory_bytes: int | None,
    share_id: str | None,
    consumed: Mapping[str, object],
) -> int | None:
    """What a device's containers may hold of its GPU's memory, or None where the
    device carries no memory share: the MPS daemon's pinned device-memory limit where
    the device was prepared with one (a share, a partition, SpacePartitioning or an
    MPS config: what the claim's processes are already held to per process), else
    the share's consumed `memory` capacity."""
    if pinned_memory_bytes:
        return pinned_memory_bytes
    memory = consumed.get("memory") if share_id else None
    if memory is None:
        return None
    try:
        value = int(parse_quantity(str(memory)))
    except ValueError:
        return None
    return value if value > 0 else None


@dataclass(frozen=True)
class MemoryLimitSite:
    """Where the plugin takes memory-limit requests, and the GPUs whose driver has
    per-cgroup memory limits (`GpuMemoryLimits.probe`)."""

    directory: Path
    gpus: frozenset[str] = field(default_factory=frozenset)
    wait_seconds: int = DEFAULT_WAIT_SECONDS

    def hooks(self, claim_uid: str, gpu_uuid: str, share_bytes: int | None) -> tuple[CdiHook, ...]:
        """The device's hook, or none: no memory share, or a GPU without the calls."""
        if share_bytes is None or gpu_uuid not in self.gpus:
            return ()
        return (
            CdiHook(
                hook_name="createRuntime",
                path=HOOK_PATH,
                args=(
                    "sh",
                    "-c",
                    HOOK_SCRIPT,
                    HOOK_ARG0,
                    str(self.directory),
                    request_prefix(claim_uid),
                    gpu_uuid,
                    str(share_bytes),
                    str(self.wait_seconds),
                ),
                timeout=self.wait_seconds + TIMEOUT_MARGIN_SECONDS,
            ),
        )


def site_for(
    data_dir: Path | str, gpus: Iterable[str], wait_seconds: int = DEFAULT_WAIT_SECONDS
) -> MemoryLimitSite | None:
    """The site for these GPUs, None where none has the calls (no hook at all)."""
    found = frozenset(gpus)
    if not found:
        return None
    return MemoryLimitSite(request_dir(data_dir), found, wait_seconds)
