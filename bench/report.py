"""The markdown table of a results document (this driver / reference ratios)."""

from __future__ import annotations

from typing import Any


def _get(doc: dict[str, Any] | None, *path: str) -> Any:
    cur: Any = doc
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return None
        cur = cur[key]
    return cur


def _fmt(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g} {unit}".strip() if value < 100 else f"{value:.0f} {unit}".strip()
    return f"{value} {unit}".strip()


def _ratio(ours: Any, ref: Any) -> str:
    if not isinstance(ours, (int, float)) or not isinstance(ref, (int, float)):
        return "-"
    if ref == 0:
        return "=" if ours == 0 else "inf"
    return f"{ours / ref:.2f}x"


ROWS: list[tuple[str, tuple[str, ...], str, float]] = [
    ("prepare, 1 claim, p50", ("prepare_1", "prepare", "p50_ms"), "ms", 1),
    ("prepare, 1 claim, p99", ("prepare_1", "prepare", "p99_ms"), "ms", 1),
    ("unprepare, 1 claim, p50", ("prepare_1", "unprepare", "p50_ms"), "ms", 1),
    ("unprepare, 1 claim, p99", ("prepare_1", "unprepare", "p99_ms"), "ms", 1),
    ("prepare, 64-claim batch, p50", ("prepare_64", "prepare", "p50_ms"), "ms", 1),
    ("prepare, 64-claim batch, p99", ("prepare_64", "prepare", "p99_ms"), "ms", 1),
    ("unprepare, 64-claim batch, p50", ("prepare_64", "unprepare", "p50_ms"), "ms", 1),
    ("repeated permanent-error prepare, p50", ("permanent_repeat", "repeat", "p50_ms"), "ms", 1),
    ("repeated permanent-error prepare, p99", ("permanent_repeat", "repeat", "p99_ms"), "ms", 1),
    (
        "  NVML calls / state writes during the repeats",
        ("permanent_repeat", "nvml_calls_during_repeats"),
        "",
        1,
    ),
    ("Xid → taint visible in the API, p50", ("xid_to_taint", "taint_visible", "p50_ms"), "ms", 1),
    ("Xid → taint visible in the API, p99", ("xid_to_taint", "taint_visible", "p99_ms"), "ms", 1),
    ("8 GPUs: start → registered", ("start_8gpu", "registered_s"), "s", 1),
    ("8 GPUs: start → published", ("start_8gpu", "published_s"), "s", 1),
    ("8 GPUs: devices published", ("start_8gpu", "devices"), "", 1),
    ("8 GPUs: slices / slice writes at start", ("start_8gpu", "slice_writes"), "", 1),
    ("8 GPUs: slice writes of a no-change resync", ("resync_8gpu", "slice_writes"), "", 1),
    ("8 GPUs: restart, start → registered", ("restart_8gpu", "registered_s"), "s", 1),
    ("8 GPUs: restart, slice writes (slices in place)", ("restart_8gpu", "slice_writes"), "", 1),
    ("64 GPUs: start → registered", ("start_64gpu", "registered_s"), "s", 1),
    ("64 GPUs: start → published", ("start_64gpu", "published_s"), "s", 1),
    ("64 GPUs: devices published", ("start_64gpu", "devices"), "", 1),
    ("64 GPUs: slice writes at start", ("start_64gpu", "slice_writes"), "", 1),
    ("64 GPUs: slice writes of a no-change resync", ("resync_64gpu", "slice_writes"), "", 1),
    ("64 H100 with MIG: start → published", ("start_mig64", "published_s"), "s", 1),
    ("64 H100 with MIG: devices / slices", ("start_mig64", "devices"), "", 1),
    ("64 H100 with MIG: slice writes at start", ("start_mig64", "slice_writes"), "", 1),
    (
        "64 H100 with MIG: slice writes of a no-change resync",
        ("resync_mig64", "slice_writes"),
        "",
        1,
    ),
    ("RSS after warm-up, 8 GPUs", ("rss_kib_8gpu",), "MiB", 1 / 1024),
    ("RSS after warm-up, 64 GPUs", ("rss_kib_64gpu",), "MiB", 1 / 1024),
    ("RSS, 64 H100 with MIG", ("rss_kib_mig64",), "MiB", 1 / 1024),
]


def _floor_row(label: str, stats: dict[str, Any]) -> str:
    return f"| {label} | {stats['p50_ms']} ms | {stats['p99_ms']} ms |"


def markdown(results: dict[str, Any]) -> str:
    ours = _get(results, "drivers", "ours") or {}
    ref = _get(results, "drivers", "reference")
    fast = _get(results, "drivers", "reference_unthrottled")
    lines = [
        "| scenario | this driver | reference | ratio (this / reference) "
        "| reference, QPS 1000 | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, path, unit, scale in ROWS:
        o = _get(ours, *path)
        r = _get(ref, *path) if ref else None
        f = _get(fast, *path) if fast else None
        if o is None and r is None:
            continue
        if label.endswith("devices / slices"):
            slices = _get(ours, path[0], "slices")
            lines.append(f"| {label} | {o} / {slices} | - | - | - | - |")
            continue
        if label.startswith("  NVML"):
            writes = _get(ours, "permanent_repeat", "state_writes_during_repeats")
            lines.append(f"| {label.strip()} | {o:.0f} / {writes:.0f} | - | - | - | - |")
            continue
        o_s = o * scale if isinstance(o, (int, float)) and scale != 1 else o
        r_s = r * scale if isinstance(r, (int, float)) and scale != 1 else r
        f_s = f * scale if isinstance(f, (int, float)) and scale != 1 else f
        ref_cell = _fmt(r_s, unit) if ref else "not run"
        fast_cell = _fmt(f_s, unit) if fast else "not run"
        lines.append(
            f"| {label} | {_fmt(o_s, unit)} | {ref_cell} | {_ratio(o, r)} "
            f"| {fast_cell} | {_ratio(o, f)} |"
        )
    floor = results.get("floor")
    if floor:
        lines += [
            "",
            "| floor (this disk, the plugin's directory) | p50 | p99 |",
            "|---|---:|---:|",
            _floor_row("fsync of a small file", floor["fsync"]),
            _floor_row("atomic write (temp, fsync, rename, dir fsync)", floor["atomic_write"]),
        ]
    note = _get(results, "reference", "note")
    if note:
        lines += ["", f"reference: {note}"]
    return "\n".join(lines) + "\n"
