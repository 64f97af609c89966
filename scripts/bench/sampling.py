"""What the bench reads off the machine: the CPU seconds and memory of processes (from
/proc), the servers' counters (from /metrics), and this disk's fsync (SQLite alone)."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import statistics
import time
from pathlib import Path

import trio

from relay_scripts.bench.conn import READ_BYTES

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU time of ``pids`` so far (those gone count nothing)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / CLOCK_TICKS


def peak_rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(match.group(1)) / 1024 if match else None


class RssSampler:
    """Samples the server's resident memory while a scenario runs; keeps the peak."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.peak: float | None = None

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            rss = peak_rss_mb(self.pid)
            if rss is not None:
                self.peak = rss if self.peak is None else max(self.peak, rss)
            await trio.sleep(0.05)


async def scrape(metrics: tuple[str, int] | None) -> dict[str, float]:
    """The writer's batch-size sum and count from /metrics."""
    if metrics is None:
        return {}
    stream = await trio.open_tcp_stream(*metrics)
    await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    data = b""
    while chunk := await stream.receive_some(READ_BYTES):
        data += chunk
    await stream.aclose()
    values = {}
    for name in ("relay_store_batch_size_sum", "relay_store_batch_size_count"):
        match = re.search(rf"^{name} (\S+)$", data.decode(), re.M)
        if match:
            values[name] = float(match.group(1))
    # Summed over queues: the jobs a scenario moved, whichever server moved them.
    for name in ("relay_jobs_submitted_total", "relay_jobs_acked_total"):
        found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", data.decode(), re.M)
        values[name] = sum(float(v) for v in found)
    return values


async def scrape_all(metrics: list[tuple[str, int]]) -> dict[str, float]:
    """``scrape`` of every server, summed."""
    total: dict[str, float] = {}
    for address in metrics:
        for name, value in (await scrape(address)).items():
            total[name] = total.get(name, 0) + value
    return total


def commit_baseline_us(db_dir: str, commits: int) -> float:
    """The median time of a single-row transaction of SQLite alone (WAL, FULL), on the
    file system the benchmark's servers use: this disk's fsync, against which the
    one-at-a-time rows of a run can be read (it drifts on a shared VM)."""
    path = os.path.join(db_dir, f"baseline-{time.monotonic_ns()}.db")
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        times = []
        for _ in range(commits):
            started = time.perf_counter()
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO t (v) VALUES (?)", ("x" * 100,))
            db.execute("COMMIT")
            times.append(time.perf_counter() - started)
    finally:
        db.close()
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(OSError):
                os.remove(path + suffix)
    return statistics.median(times) * 1e6
