"""MIG devices known to be gone, by UUID (NVML never gives a UUID to another device).

A recorded device that the MIG manager destroyed, or found gone, stays gone: what sits
at its ids later is someone else's, however often its claim's teardown is repeated
(docs/mig.md, "A GPU instance without a compute instance"). In memory only, the
least recently asked about forgotten first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

# A record asked about again (a teardown that keeps failing on another device of its
# claim) stays remembered.
KEPT = 4096


class GoneDevices:
    def __init__(self) -> None:
        self._uuids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, uuid: object) -> bool:
        with self._lock:
            if uuid not in self._uuids:
                return False
            self._uuids.move_to_end(str(uuid))
            return True

    def add(self, uuid: str) -> None:
        with self._lock:
            self._uuids[uuid] = None
            self._uuids.move_to_end(uuid)
            while len(self._uuids) > KEPT:
                self._uuids.popitem(last=False)
