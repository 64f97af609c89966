"""What a run shows and writes: a line per scenario as it completes, the tables (rates,
latency percentiles, cost per job), the closing line with the disk baseline, the JSON."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import attrs
import orjson
from rich.console import Console
from rich.table import Table

from relay_scripts.bench.results import Result


def progress(console: Console, result: Result) -> None:
    """One scenario's line, printed as it completes."""
    extra = "".join(f", {k} {v:,}" for k, v in result.extra.items() if isinstance(v, int))
    console.print(
        f"{time.strftime('%H:%M:%S')} {result.scenario} [{result.sync}]: "
        f"{result.median:,.1f} {result.unit}{extra}",
        highlight=False, soft_wrap=True,
    )  # fmt: skip


def render(results: list[Result], console: Console) -> None:
    table = Table(title="relay-bench (medians; min-max across runs)")
    for column in ("scenario", "sync", "median", "min-max", "unit", "peak RSS MB", "batch"):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for r in results:
        digits = 1 if r.unit == "ms" else 0
        spread = f"{min(r.runs):,.{digits}f}-{max(r.runs):,.{digits}f}" if len(r.runs) > 1 else "-"
        if r.unit == "ms":
            table.add_row(r.scenario, r.sync, f"{r.median:.1f}", spread, "p99 ms", "-", "-")
            continue
        table.add_row(
            r.scenario, r.sync, f"{r.median:,.0f}", spread, r.unit,
            "-" if r.peak_rss_mb is None else f"{r.peak_rss_mb:.0f}",
            "-" if r.mean_batch is None else f"{r.mean_batch:.1f}",
        )  # fmt: skip
    console.print(table)
    latencies = [r for r in results if r.unit == "ms"]
    if latencies:
        console.print(_latency_table(latencies))
    costs = [r for r in results if "server_cpu_us_per_job" in r.extra]
    if costs:
        console.print(_cost_table(costs))


COST_COLUMNS = {
    "server_cpu_cores": ("servers' CPU, cores", "{:.2f}"),
    "server_cpu_us_per_job": ("servers' CPU us/job", "{:.0f}"),
    "db_cpu_cores": ("db CPU, cores", "{:.2f}"),
    "db_cpu_us_per_job": ("db CPU us/job", "{:.0f}"),
    "db_xacts_per_job": ("db commits/job", "{:.3f}"),
    "db_rows_written_per_job": ("db rows written/job", "{:.1f}"),
}


def _cost_table(results: list[Result]) -> Table:
    """What each job cost (medians across runs): CPU of the servers and of the database,
    and the database's commits and rows written per job."""
    table = Table(title="cost per job (medians across runs)")
    table.add_column("scenario", justify="left")
    for title, _ in COST_COLUMNS.values():
        table.add_column(title, justify="right")
    for r in results:
        cells = [
            fmt.format(r.extra[key]) if key in r.extra else "-"
            for key, (_, fmt) in COST_COLUMNS.items()
        ]
        table.add_row(r.scenario, *cells)
    return table


def _latency_table(latencies: list[Result]) -> Table:
    """Each latency scenario's percentiles (medians across runs), to the handler's start
    and to the committed ack."""
    table = Table(title="end-to-end latency, ms (submit sent -> handler start / ack committed)")
    table.add_column("offered", justify="left")
    for stage in ("start", "ack"):
        for q in ("p50", "p90", "p99", "max"):
            table.add_column(f"{stage} {q}", justify="right")
    for r in latencies:
        rate = r.scenario.removeprefix("end-to-end latency at ")
        cells = [
            f"{r.extra[f'{stage}_{q}_ms']:.1f}"
            for stage in ("start", "ack")
            for q in ("p50", "p90", "p99", "max")
        ]
        table.add_row(rate, *cells)
    return table


def closing_line(console: Console, scenarios: int, seconds: float, before: float,
                 after: float) -> None:  # fmt: skip
    """How many scenarios in how long, on how many CPUs, and this disk's fsync (a
    single-row FULL commit of SQLite alone) before and after them."""
    console.print(f"{scenarios} scenarios in {seconds:.0f} s; "
                  f"machine: {os.cpu_count()} cpus; a single-row FULL commit of SQLite "
                  f"alone here: {before:.0f} us before, {after:.0f} us after")  # fmt: skip


def write_json(path: str, quick: bool, runs: int, before: float, after: float,
               results: list[Result]) -> None:  # fmt: skip
    """The machine, the run's settings and every result (its median included)."""
    Path(path).write_bytes(orjson.dumps({
        "machine": {
            "cpus": os.cpu_count(), "python": sys.version.split()[0],
            "sqlite_commit_us": {"before": before, "after": after},
        },
        "quick": quick, "runs": runs,
        "results": [attrs.asdict(r) | {"median": r.median} for r in results],
    }, option=orjson.OPT_INDENT_2))  # fmt: skip
