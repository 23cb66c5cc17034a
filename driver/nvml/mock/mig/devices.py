"""The mock node's kernel device registry: `<driver root>/proc/devices`, as the NVIDIA
kernel modules leave it on a real node (driver 550 and later name the GPU device
`nvidia`; the UVM and capability majors are assigned dynamically, these are typical).

The plugin reads device majors from it when it writes complete CDI device nodes on the
mock (a node with a fake driver installation), as it reads `/proc/devices` on a real
node. A container runtime creates such nodes in the container; without the NVIDIA
kernel module opening one fails (ENXIO), which is all a GPU-less test needs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

PROC_DEVICES: Final = Path("proc/devices")
TEXT: Final = """Character devices:
  1 mem
  4 tty
  5 /dev/tty
 10 misc
195 nvidia
195 nvidiactl
234 nvidia-uvm
237 nvidia-caps

Block devices:
  7 loop
"""


def ensure_proc_devices(driver_root: Path) -> Path:
    """Write the registry under the mock's driver root unless it is there."""
    path = driver_root / PROC_DEVICES
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(TEXT)
        tmp.replace(path)
    return path
