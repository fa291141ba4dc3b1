#!/usr/bin/env python
"""Plot output throughput and median TTFT against concurrency from `bench/serve.py` result files.

    python bench/plot.py results/vlm-serve.json results/mlx-vlm.json -o results/compare.png

Every run of every file becomes a point; points are grouped into one line per label (the file's
--label, else its file name). Runs without a max concurrency (pure request-rate runs) are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

Point = tuple[int, "float | None", "float | None", "float | None"]


def load_series(paths: Sequence[str]) -> dict[str, list[Point]]:
    """label -> [(concurrency, output tok/s, steady output tok/s, TTFT p50 ms)], sorted by concurrency."""
    series: dict[str, list[Point]] = defaultdict(list)
    for path in paths:
        with open(path) as f:
            result: dict[str, Any] = json.load(f)
        label = result.get("label") or os.path.splitext(os.path.basename(path))[0]
        for run in result.get("runs", []):
            concurrency = run.get("max_concurrency")
            if not concurrency:
                continue
            m = run["metrics"]
            series[label].append((concurrency, m.get("output_throughput"), m.get("steady_output_throughput"),
                                  m.get("ttft_ms", {}).get("median")))
    return {label: sorted(points, key=lambda p: p[0]) for label, points in series.items()}


def plot(series: dict[str, list[Point]], output: str, title: str | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench/plot.py needs matplotlib: pip install matplotlib "
                         "(or pip install -e '.[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, points in series.items():
        xs = [p[0] for p in points]
        line, = ax_tp.plot(xs, [p[1] for p in points], marker="o", label=label)
        if any(p[2] is not None for p in points):
            ax_tp.plot(xs, [p[2] for p in points], linestyle="--", color=line.get_color(), alpha=0.6,
                       label=f"{label} (steady)")
        ax_ttft.plot(xs, [p[3] for p in points], marker="o", color=line.get_color(), label=label)
    ticks = sorted({p[0] for points in series.values() for p in points})
    for ax, ylabel in ((ax_tp, "output tokens/s"), (ax_ttft, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_tp.set_title("Output throughput")
    ax_ttft.set_title("Time to first token (median)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="result JSON files written by bench/serve.py")
    parser.add_argument("-o", "--output", default="bench_plot.png", help="PNG path")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    series = load_series(args.results)
    if not series:
        print("no runs with a max concurrency in these files", file=sys.stderr)
        return 1
    plot(series, args.output, args.title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
