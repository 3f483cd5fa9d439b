"""PNG plots of a benchmark run: TTFB and underruns against concurrency.

matplotlib is optional (the `bench` extra): without it no plots are written and the JSON results
stand alone, so a benchmark that has measured never fails for want of a plotting library."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any


def plot_results(results: dict[str, Any], stem: Path) -> list[Path]:
    """Write <stem>_<series>.png for every series of rows that has a concurrency sweep (none without
    matplotlib)."""
    series = sweeps(results)
    if not series:
        return []
    if importlib.util.find_spec("matplotlib") is None:
        logging.getLogger(__name__).warning("matplotlib is not installed: no plots (the JSON has every number)")
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    for name, rows in series.items():
        xs = [r["concurrency"] for r in rows]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for key, label in (("ttfb_p50_ms", "p50"), ("ttfb_p95_ms", "p95"), ("ttfb_p99_ms", "p99")):
            ax1.plot(xs, [r[key] for r in rows], marker="o", label=label)
        target = results.get("ttfb_target_ms")
        if target:
            ax1.axhline(target, color="grey", linestyle="--", label=f"target {target:g} ms")
        ax1.set(xlabel="concurrent streams", ylabel="TTFB (ms)", title=f"{name}: time to first audio")
        ax1.legend()
        ax2.plot(xs, [r["underrun_streams"] for r in rows], marker="o", label="streams with underruns")
        ax2.plot(xs, [r["realtime_streams"] for r in rows], marker="s", label="real-time streams")
        ax2.set(xlabel="concurrent streams", ylabel="streams", title=f"{name}: underruns")
        ax2.legend()
        fig.tight_layout()
        path = stem.parent / f"{stem.name}_{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def sweeps(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for name in ("scaling", "sim"):
        section = results.get(name)
        if section and len(section.get("rows", [])) > 1:
            out[name] = section["rows"]
    return out
