"""This boot of the node: what tells a record made before a reboot (which empties the
CDI root and destroys every MIG device) from one of this boot."""

from __future__ import annotations

from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot of the node's kernel (the same in every container); "" if unknown."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""
