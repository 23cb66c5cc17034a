"""The prepare-latency plot (docs/prepare-latency.png) from a results document."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {
        "ours": "this driver",
        "reference": "Go reference (defaults: 5 QPS)",
        "reference_unthrottled": "Go reference (QPS 1000)",
        "nvidia": "NVIDIA gpu-kubelet-plugin (QPS 1000)",
    }
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in (
        (axes[0], "prepare_1", "NodePrepareResources, 1 claim"),
        (axes[1], "prepare_64", "NodePrepareResources, 64-claim batch"),
    ):
        for driver in names:
            samples = [
                s
                for run in results.get("runs", [])
                if run["driver"] == driver
                for s in ((run["results"].get(key) or {}).get("prepare") or {}).get("samples_s", [])
            ]
            if not samples:
                continue
            ms = sorted(s * 1000 for s in samples)
            ys = [(i + 1) / len(ms) for i in range(len(ms))]
            ax.step(ms, ys, where="post", label=f"{names.get(driver, driver)} (n={len(ms)})")
        floor = (results.get("floor") or {}).get("atomic_write", {}).get("p50_ms")
        if floor and key == "prepare_1":
            ax.axvline(
                floor, color="grey", linestyle=":", label=f"one atomic write p50 ({floor} ms)"
            )
        ax.set_xscale("log")
        ax.set_xlabel("latency (ms, log scale)")
        ax.set_ylabel("fraction of calls ≤ x")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    m = results.get("machine", {})
    fig.suptitle(
        f"Prepare latency (CDF), {m.get('nproc')} cores, {m.get('cpu_model', '')}", fontsize=9
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m bench.plot bench/results/<date>.json docs/prepare-latency.png")
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    plot(json.loads(src.read_text()), dst)
    print(dst)
