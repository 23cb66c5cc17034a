"""Per-node overrides of the plugin's settings, read from labels on its Node object.

`<driver name>/mig-profiles` (e.g. `gpu.example.com/mig-profiles=1g10gb_3g40gb`)
replaces `--mig-profiles` on that node: a node pool can publish the MIG layout it uses.
A label value holds no commas, dots or plus signs, so profiles are written as the
device names label them, joined by `_`. The label is read once at start; a change
takes effect at the plugin's next start. A bad value stops the start with one line
naming the label; a Node that cannot be read leaves the flag's value, with a warning.

The start reads it with `NodeLabelRead`, in a thread of its own, while recovery and
discovery run: its round trip to the API server (a TLS handshake first) overlaps the
local work instead of adding to the time before the kubelet can register the plugin.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from driver.kube.api import segment
from driver.plugin.options import setting_values
from driver.plugin.options.settings import SettingError

log = logging.getLogger(__name__)


class NodeReader(Protocol):
    def request(self, method: str, path: str) -> object: ...


def node_mig_profiles(api: NodeReader, node_name: str, driver_name: str) -> tuple[str, ...] | None:
    """The profiles the Node's label selects, or None without the label (or Node)."""
    label = f"{driver_name}/mig-profiles"
    try:
        node = api.request("GET", f"/api/v1/nodes/{segment(node_name)}")
    except Exception as err:  # the API is down or forbids it: the flag's value stands
        log.warning("reading Node %s for its %s label: %s", node_name, label, err)
        return None
    labels = node.get("metadata", {}).get("labels") or {} if isinstance(node, dict) else {}
    value = labels.get(label)
    if value is None:
        return None
    try:
        return setting_values.mig_profiles(str(value))
    except ValueError as err:
        raise SettingError(f"node label {label}={value!r}: {err}") from err


class NodeLabelRead:
    """`node_mig_profiles`, sent at construction in a thread of its own."""

    def __init__(self, api: NodeReader, node_name: str, driver_name: str) -> None:
        self._done = threading.Event()
        self._profiles: tuple[str, ...] | None = None
        self._error: BaseException | None = None
        # A daemon: a start that fails meanwhile exits without waiting for the API.
        threading.Thread(
            target=self._read, args=(api, node_name, driver_name), name="node-labels", daemon=True
        ).start()

    def _read(self, api: NodeReader, node_name: str, driver_name: str) -> None:
        try:
            self._profiles = node_mig_profiles(api, node_name, driver_name)
        except BaseException as err:  # raised to the start by profiles()
            self._error = err
        finally:
            self._done.set()

    def profiles(self) -> tuple[str, ...] | None:
        """Waits for the read: what `node_mig_profiles` returned, or what it raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._profiles
