"""Disk full while writing CDI specs and the checkpoint.

The plugin's CDI root and data dir are small tmpfs mounts; a filler file takes the
remaining space before a call. Every failing call must answer a clear transient error
(the kubelet retries), leave no corrupt journal, no temp file and no half-written
spec, and succeed once space is freed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.proto.dra.v1 import api_pb2
from tests.conftest import Cluster, FakeNode
from tests.integration.plugin_process import DRIVER, PluginProcess
from tests.reliability.support import (
    PLUGIN_DIRS,
    allocated_claim,
    api_for,
    assert_consistent,
    ensure_namespace,
    start_instance,
)

NS = "reliability-disk"


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mount.returncode != 0:
        pytest.fail(f"disk-full test needs to mount a small tmpfs (root): {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def filled(directory: Path, leave_bytes: int = 0) -> Iterator[None]:
    """Fill the file system of `directory` up, leaving about `leave_bytes`."""
    filler = directory / "zz-filler"
    chunk = b"\0" * 4096
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            os.write(fd, chunk)
    except OSError as err:
        assert err.errno == errno.ENOSPC, err
    finally:
        os.close(fd)
    if leave_bytes:
        os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))
    try:
        yield
    finally:
        filler.unlink()


def _assert_transient_disk_error(message: str, error_type: int) -> None:
    assert message, "no error although the disk is full"
    assert error_type != api_pb2.Permanent, message
    assert not message.startswith("permanent"), message
    assert "No space left on device" in message or "ENOSPC" in message, message


FAULTS = (
    # (where the space runs out, the call, bytes left, must it fail? None: either)
    ("cdi", "prepare", 0, True),
    ("data", "prepare", 0, True),
    ("data", "prepare", 4096, None),  # one page: the journal may just fit
    ("data", "unprepare", 0, True),  # the shrunk journal still needs a new file
    ("both", "prepare", 0, True),
    ("cdi", "unprepare", 0, False),  # removing a spec needs no space
)


def test_disk_full_while_writing_cdi_and_checkpoint(
    cluster: Cluster, node: FakeNode, root: Path, figures: Counter[str]
) -> None:
    api = api_for(cluster)
    ensure_namespace(api, NS)
    # Enough prepared claims that the journal is larger than one page.
    refs = [allocated_claim(api, node.name, NS, f"disk-{i}", f"gpu-{i}") for i in range(8)]
    base, victim = refs[:7], refs[7]
    # Where a plugin with this root keeps its kubelet-like directories.
    layout = PluginProcess(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root)
    PLUGIN_DIRS.add(layout.registry_dir.parent)
    with (
        small_tmpfs(layout.plugins_dir, "192k") as plugins_dir,
        small_tmpfs(layout.cdi_root, "192k") as cdi_root,
    ):
        # The mock GPUs' MIG state lives beside, not in, the file systems run full:
        # on a real node it is the GPU's, not the plugin's disk.
        inst = start_instance(
            cluster, node, root, env={"MOCK_DRIVER_ROOT": str(root / "mock-driver-root")}
        )
        try:
            assert inst.plugin.data_dir.parent == plugins_dir and inst.plugin.cdi_root == cdi_root
            kubelet = inst.kubelet
            result = kubelet.prepare(DRIVER, base)
            assert all(r.error == "" for r in result.values()), result
            prepared = {r.uid for r in base}
            assert_consistent(inst.plugin, prepared)

            for where, op, leave, must_fail in FAULTS:
                targets = {
                    "cdi": [cdi_root],
                    "data": [plugins_dir],
                    "both": [cdi_root, plugins_dir],
                }
                if op == "unprepare":
                    assert kubelet.prepare(DRIVER, [victim])[victim.uid].error == ""
                    prepared.add(victim.uid)
                with contextlib.ExitStack() as stack:
                    for directory in targets[where]:
                        stack.enter_context(filled(directory, leave))
                    figures["disk full: faults injected"] += 1
                    if op == "prepare":
                        res = kubelet.prepare(DRIVER, [victim])[victim.uid]
                        if must_fail is not None:
                            assert bool(res.error) == must_fail, (where, op, res.error)
                        if res.error:
                            _assert_transient_disk_error(res.error, res.error_type)
                            figures["disk full: clear transient errors"] += 1
                        else:  # enough room was left for this write: fine, but say so
                            prepared.add(victim.uid)
                    else:
                        ures = kubelet.unprepare(DRIVER, [victim])[victim.uid]
                        if must_fail is not None:
                            assert bool(ures.error) == must_fail, (where, op, ures.error)
                        if ures.error:
                            _assert_transient_disk_error(ures.error, api_pb2.Unknown)
                            figures["disk full: clear transient errors"] += 1
                        else:
                            prepared.discard(victim.uid)
                    inst.plugin.check_alive()
                    # Whatever happened, the journal is intact and nothing is half-done
                    # (a failed unprepare may have removed the spec already: then the
                    # journal entry alone remains until the retry).
                    if op == "prepare":
                        assert_consistent(inst.plugin, prepared)
                # Space is back: the kubelet's retry succeeds and the state is exact.
                if op == "prepare":
                    res = kubelet.prepare(DRIVER, [victim])[victim.uid]
                    assert res.error == "", f"{where}/{op}: retry failed: {res.error}"
                    prepared.add(victim.uid)
                    assert kubelet.unprepare(DRIVER, [victim])[victim.uid].error == ""
                    prepared.discard(victim.uid)
                else:
                    assert kubelet.unprepare(DRIVER, [victim])[victim.uid].error == ""
                    prepared.discard(victim.uid)
                assert_consistent(inst.plugin, prepared)
                figures["disk full: recovered after space freed"] += 1

            assert all(r.error == "" for r in kubelet.unprepare(DRIVER, base).values())
            assert_consistent(inst.plugin, set())
        finally:
            inst.stop()
