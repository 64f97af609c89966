"""Turn relay-bench JSON into a PNG for docs/benchmarking.md.

    pip install -e '.[bench]'          # matplotlib, an optional extra
    python scripts/plot_bench.py bench.json docs/bench.png

Three panels: throughput of every rate scenario (median with min-max), the worker
concurrency-scaling curve, and end-to-end latency percentiles at each offered rate.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import orjson


def load(path: str) -> list[dict[str, Any]]:
    return orjson.loads(Path(path).read_bytes())["results"]


def scaling_points(results: list[dict[str, Any]]) -> list[tuple[int, float, float, float]]:
    """(concurrency, median, min, max) of the relay.Worker scenarios, by concurrency."""
    points = []
    for r in results:
        match = re.search(r"relay\.Worker concurrency (\d+)", r["scenario"])
        if match:
            points.append((int(match.group(1)), r["median"], min(r["runs"]), max(r["runs"])))
    return sorted(points)


def latency_rows(results: list[dict[str, Any]]) -> list[tuple[str, dict[str, float]]]:
    return [(r["scenario"], r["extra"]) for r in results if r["unit"] == "ms"]


def plot(results: list[dict[str, Any]], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_bench needs matplotlib: pip install -e '.[bench]'")

    rates = [r for r in results if r["unit"] == "jobs/s"]
    fig, (ax_rates, ax_scale, ax_lat) = plt.subplots(
        3, 1, figsize=(10, 13), gridspec_kw={"height_ratios": [3, 2, 2]}
    )
    labels = [f"{r['scenario']} [{r['sync']}]" for r in rates]
    medians = [r["median"] for r in rates]
    low = [r["median"] - min(r["runs"]) for r in rates]
    high = [max(r["runs"]) - r["median"] for r in rates]
    ax_rates.barh(labels, medians, xerr=[low, high], color="#4c72b0")
    ax_rates.invert_yaxis()
    ax_rates.set_xlabel("jobs/s (median of runs, bars: min-max)")
    ax_rates.tick_params(axis="y", labelsize=7)
    ax_rates.set_title("relay-bench throughput")

    points = scaling_points(results)
    if points:
        xs = [p[0] for p in points]
        ax_scale.errorbar(
            xs, [p[1] for p in points],
            yerr=[[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]],
            marker="o", capsize=4,
        )  # fmt: skip
        ax_scale.set_xscale("log", base=2)
        ax_scale.set_xticks(xs, [str(x) for x in xs])
        ax_scale.set_xlabel("relay.Worker concurrency (no-op handler)")
        ax_scale.set_ylabel("lease+ack jobs/s")
        ax_scale.set_title("Concurrency scaling")

    rows = latency_rows(results)
    if rows:
        keys = ["p50_ms", "p90_ms", "p99_ms", "max_ms"]
        width = 0.8 / (2 * len(rows))
        for i, (name, extra) in enumerate(rows):
            for j, stage in enumerate(("start", "ack")):
                offset = (2 * i + j) * width
                ax_lat.bar(
                    [k + offset for k in range(len(keys))],
                    [extra.get(f"{stage}_{key}", 0) for key in keys],
                    width, label=f"{name.replace('end-to-end latency at ', '')}: "
                    f"{'handler started' if stage == 'start' else 'ack committed'}",
                )  # fmt: skip
        ax_lat.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], keys)
        ax_lat.set_ylabel("ms after submit sent")
        ax_lat.set_title("End-to-end latency")
        ax_lat.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: plot_bench.py BENCH.json OUT.png")
    plot(load(sys.argv[1]), sys.argv[2])


if __name__ == "__main__":
    main()
