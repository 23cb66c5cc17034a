"""A fake NVIDIA driver installation, laid out as the installer does: ELF libraries
with their SONAMEs and soname links, executables, GSP firmware, character device nodes.
NVIDIA's CDI generator (nvcdi) reads exactly these; the integration tier compares its
output with nvidia-ctk's over such a root, and the e2e tier mounts one into containers
on the local node. Needs root (mknod).
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

DRIVER_VERSION = "580.95.05"

# Versioned driver libraries and the SONAME each carries in a real installation.
LIBRARIES = {
    "libcuda.so": "libcuda.so.1",
    "libnvidia-ml.so": "libnvidia-ml.so.1",
    "libnvidia-ptxjitcompiler.so": "libnvidia-ptxjitcompiler.so.1",
    "libnvidia-nvvm.so": "libnvidia-nvvm.so.4",
    "libnvidia-gpucomp.so": f"libnvidia-gpucomp.so.{DRIVER_VERSION}",
    "libnvidia-allocator.so": "libnvidia-allocator.so.1",
    "libcudadebugger.so": "libcudadebugger.so.1",
    "libnvidia-opencl.so": "libnvidia-opencl.so.1",
    "libnvidia-cfg.so": "libnvidia-cfg.so.1",
}
# Development links the runfile installer adds next to the soname links.
DEV_LINKS = ("libcuda.so", "libnvidia-ml.so", "libnvidia-cfg.so")
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
NVIDIA_MAJOR, UVM_MAJOR = 195, 507
DEVICE_NODES = {
    "nvidiactl": (NVIDIA_MAJOR, 255),
    "nvidia0": (NVIDIA_MAJOR, 0),
    "nvidia1": (NVIDIA_MAJOR, 1),
    "nvidia-modeset": (NVIDIA_MAJOR, 254),
    "nvidia-uvm": (UVM_MAJOR, 0),
    "nvidia-uvm-tools": (UVM_MAJOR, 1),
}
CONTROL_NODES = ("nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-uvm-tools")


def write_elf_library(path: Path, soname: str) -> None:
    """A minimal x86-64 ELF shared object whose only content is a DT_SONAME.

    nvcdi reads the SONAME (debug/elf: the SHT_DYNAMIC section and its string table) to
    decide which soname and .so links nvidia-cdi-hook creates in the container.
    """
    dynstr = b"\0" + soname.encode() + b"\0"
    shstrtab = b"\0.dynstr\0.dynamic\0.shstrtab\0"
    ehdr_size, phdr_size, shdr_size = 64, 56, 64
    dynstr_off = ehdr_size + 2 * phdr_size
    dynamic_off = (dynstr_off + len(dynstr) + 7) & ~7
    dt_null, dt_strtab, dt_strsz, dt_soname = 0, 5, 10, 14
    dynamic = b"".join(
        struct.pack("<qQ", tag, value)
        for tag, value in (
            (dt_soname, 1),
            (dt_strtab, dynstr_off),
            (dt_strsz, len(dynstr)),
            (dt_null, 0),
        )
    )
    shstrtab_off = dynamic_off + len(dynamic)
    shdr_off = (shstrtab_off + len(shstrtab) + 7) & ~7
    end = shstrtab_off  # what is loaded: headers, .dynstr, .dynamic
    pt_load, pt_dynamic, pf_r, pf_rw = 1, 2, 4, 6
    phdrs = struct.pack("<IIQQQQQQ", pt_load, pf_r, 0, 0, 0, end, end, 0x1000)
    phdrs += struct.pack(
        "<IIQQQQQQ",
        pt_dynamic,
        pf_rw,
        dynamic_off,
        dynamic_off,
        dynamic_off,
        len(dynamic),
        len(dynamic),
        8,
    )
    sht_strtab, sht_dynamic, shf_alloc, shf_write = 3, 6, 2, 1
    shdrs = bytes(shdr_size)  # SHN_UNDEF
    # name offset, type, flags, addr, offset, size, link, info, addralign, entsize
    shdrs += struct.pack(
        "<IIQQQQIIQQ", 1, sht_strtab, shf_alloc, dynstr_off, dynstr_off, len(dynstr), 0, 0, 1, 0
    )
    shdrs += struct.pack(
        "<IIQQQQIIQQ",
        9,
        sht_dynamic,
        shf_alloc | shf_write,
        dynamic_off,
        dynamic_off,
        len(dynamic),
        1,  # sh_link: .dynstr
        0,
        8,
        16,
    )
    shdrs += struct.pack(
        "<IIQQQQIIQQ", 18, sht_strtab, 0, 0, shstrtab_off, len(shstrtab), 0, 0, 1, 0
    )
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, SysV
    et_dyn, em_x86_64 = 3, 62
    ehdr = struct.pack(
        "<16sHHIQQQIHHHHHH",
        ident,
        et_dyn,
        em_x86_64,
        1,
        0,
        ehdr_size,
        shdr_off,
        0,
        ehdr_size,
        phdr_size,
        2,
        shdr_size,
        4,
        3,
    )
    image = bytearray(shdr_off + len(shdrs))
    for offset, blob in (
        (0, ehdr),
        (ehdr_size, phdrs),
        (dynstr_off, dynstr),
        (dynamic_off, dynamic),
        (shstrtab_off, shstrtab),
        (shdr_off, shdrs),
    ):
        image[offset : offset + len(blob)] = blob
    path.write_bytes(bytes(image))
    path.chmod(0o755)


@dataclass(frozen=True)
class FakeDriver:
    root: Path
    lib_dir: str  # as seen from the root, e.g. /usr/lib/x86_64-linux-gnu
    bin_dir: str


def make_driver_root(root: Path, standin: Path, lib_dir: str, bin_dir: str) -> FakeDriver:
    """Lay out a driver installation under root, as the installer would."""
    libs = root / lib_dir.lstrip("/")
    libs.mkdir(parents=True, exist_ok=True)
    for name, soname in LIBRARIES.items():
        versioned = f"{name}.{DRIVER_VERSION}"
        if name == "libnvidia-ml.so":
            (libs / versioned).write_bytes(standin.read_bytes())
        else:
            write_elf_library(libs / versioned, soname)
        if soname != versioned:
            (libs / soname).symlink_to(versioned)
    for name in DEV_LINKS:
        (libs / name).symlink_to(LIBRARIES[name])

    bins = root / bin_dir.lstrip("/")
    bins.mkdir(parents=True, exist_ok=True)
    for name in BINARIES:
        exe = bins / name
        exe.write_text(f"#!/bin/sh\necho '{name} of the fake driver {DRIVER_VERSION}'\n")
        exe.chmod(0o755)

    firmware = root / "lib" / "firmware" / "nvidia" / DRIVER_VERSION
    firmware.mkdir(parents=True)
    for name in FIRMWARE:
        (firmware / name).write_bytes(b"GSP firmware of the fake driver\n")

    dev = root / "dev"
    dev.mkdir()
    for name, (major, minor) in DEVICE_NODES.items():
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    return FakeDriver(root=root, lib_dir=lib_dir, bin_dir=bin_dir)
