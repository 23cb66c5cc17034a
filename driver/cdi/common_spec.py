"""The common CDI spec, kept in step with the node: written at start, refreshed before
claim specs are written when the driver root holds another driver version or the
kernel registered another NVIDIA device (the UVM module is loaded on first CUDA use).

On the mock there is no driver: the common spec carries the node and driver names only.
On real GPUs a prepare whose driver edits cannot be generated fails transiently with
the reason (the driver container may not be up yet), rather than start a container
without the driver's libraries.
"""

from __future__ import annotations

import logging
from pathlib import Path

from driver.cdi.claim_specs import CdiSpecs
from driver.cdi.device_nodes import CharMajors, DeviceNode, DeviceNodeError
from driver.cdi.driver_edits import DriverEdits, DriverEditsError, DriverRoot, generate
from driver.errors import transient

log = logging.getLogger(__name__)

MODESET_NODE = Path("/dev/nvidia-modeset")


class CommonSpec:
    def __init__(
        self,
        cdi: CdiSpecs,
        node_name: str,
        driver_root: DriverRoot | None,
        *,
        proc_devices: Path = Path("/proc/devices"),
        generator: Path | None = None,
    ) -> None:
        self.cdi = cdi
        self.node_name = node_name
        self.driver_root = driver_root
        self.proc_devices = proc_devices
        self.generator = generator
        self.problem: str | None = None  # why the driver's edits are missing
        # The device majors the last sync read (claim specs of the same request use them).
        self.majors: CharMajors | None = None
        # What the common spec on disk holds (no driver: not written with one yet).
        self._driver: DriverEdits | None = None
        self._nodes: tuple[DeviceNode, ...] = ()

    def write(self) -> None:
        """At start: write what can be known now; a missing driver is logged, not fatal
        (prepare retries and reports it)."""
        try:
            self._sync(force=True)
        except DriverEditsError as err:
            log.error("common CDI spec without the driver's files: %s", err)

    def refresh(self) -> None:
        """Before claim specs are written (under the node lock). Raises a transient
        DriverError when the driver's edits cannot be had."""
        try:
            self._sync(force=False)
        except DriverEditsError as err:
            raise transient(str(err)) from err

    def _sync(self, *, force: bool) -> None:
        if self.driver_root is None:  # nothing on the node to follow
            if force:
                self.cdi.write_common_spec(self.node_name)
            return
        driver = self._driver
        if driver is None or not driver.is_current(self.driver_root):
            driver = self._generate(self.driver_root)
        nodes = self._control_nodes()
        if force or (driver, nodes) != (self._driver, self._nodes):
            self.cdi.write_common_spec(self.node_name, driver, nodes)
            if self._driver is not None and driver != self._driver:
                log.info("common CDI spec rewritten for driver %s", driver.driver_version)
            self._driver, self._nodes = driver, nodes

    def _generate(self, root: DriverRoot) -> DriverEdits:
        try:
            driver = generate(root, self.generator)
        except DriverEditsError as err:
            self.problem = str(err)
            if self._driver is None:  # the node and driver names at least
                try:
                    nodes = self._control_nodes()
                except DriverEditsError:
                    nodes = ()
                self.cdi.write_common_spec(self.node_name, None, nodes)
            raise
        self.problem = None
        log.info(
            "driver %s at %s: %d mounts, %d hooks for every GPU container",
            driver.driver_version,
            root.host_path,
            len(driver.edits.get("mounts", [])),
            len(driver.edits.get("hooks", [])),
        )
        return driver

    def _control_nodes(self) -> tuple[DeviceNode, ...]:
        try:
            self.majors = CharMajors.read(self.proc_devices)
            return self.majors.control_nodes(modeset=MODESET_NODE.exists())
        except (OSError, DeviceNodeError) as err:
            raise DriverEditsError(f"control device nodes: {err}") from err
