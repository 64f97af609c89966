"""relay-bench keeps working: its quick run completes and its report is complete and
plausible. (Speed is the benchmark's business, not the tests': no number is asserted.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from tests import pg

BENCH = str(Path(sys.executable).parent / "relay-bench")
EXPECTED = [
    "submit, 1 producer(s) one-at-a-time",
    "submit, 8 producer(s) one-at-a-time",
    "submit, 32 producer(s) one-at-a-time",
    "submit, 1 connection pipelining (window 64)",
    "submit_batch of 100, 1 client(s)",
    "submit_batch of 100, 4 client(s)",
    "lease+ack, 8 processes, count 8, pipelined acks",
    "lease+ack, relay.Worker concurrency 1",
    "lease+ack, relay.Worker concurrency 4",
    "lease+ack, relay.Worker concurrency 16",
    "lease+ack, relay.Worker concurrency 64",
    "lease+ack with 1,000 ready jobs (raw, count 8)",
    "lease+ack with 20,000 ready jobs (raw, count 8)",
]


def test_quick_bench_reports_every_scenario(tmp_path):
    out = tmp_path / "bench.json"
    finished = subprocess.run(
        [BENCH, "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-2000:]
    report = orjson.loads(out.read_bytes())
    # The disk baseline, before and after: an fsync'd commit takes some time, not hours.
    commit_us = report["machine"]["sqlite_commit_us"]
    assert all(1 < commit_us[when] < 1_000_000 for when in ("before", "after")), commit_us
    results = report["results"]
    scenarios = {(r["scenario"], r["sync"]) for r in results}
    for name in EXPECTED:
        assert (name, "full") in scenarios, name
    for name in EXPECTED[:6]:  # the submit scenarios run with NORMAL too
        assert (name, "normal") in scenarios, name
    for r in results:
        assert len(r["runs"]) == 1 and r["median"] > 0, r
        if r["unit"] == "jobs/s":
            # A real server ran: its memory was sampled and its writer committed batches.
            assert 5 < r["peak_rss_mb"] < 2_000, r
            assert r["mean_batch"] >= 1, r
    latency = [r for r in results if r["unit"] == "ms"]
    assert latency, "no latency scenario"
    for r in latency:
        extra = r["extra"]
        for stage in ("start", "ack"):
            p50, p90, p99, top = (extra[f"{stage}_{k}"] for k in ("p50_ms", "p90_ms",
                                                                  "p99_ms", "max_ms"))  # fmt: skip
            assert 0 < p50 <= p90 <= p99 <= top, extra
        assert extra["start_p50_ms"] <= extra["ack_p50_ms"]
    # Both tables were printed, too, with one line per scenario (not wrapped in a log).
    assert "relay-bench" in finished.stdout
    assert "end-to-end latency, ms" in finished.stdout
    for name in EXPECTED:
        assert name in finished.stdout, name


def test_bench_runs_on_postgres_with_two_servers(tmp_path, pg_url):
    """``--db URL --servers 2``: the servers share a fresh database, which the bench drops
    afterwards; a reduced set of scenarios (the full quick run takes minutes on PostgreSQL)."""
    out = tmp_path / "bench.json"
    finished = subprocess.run(
        [BENCH, "--quick", "--db", pg.server_url(pg_url), "--servers", "2",
         "--scenarios", "8 producer(s) one-at-a-time",
         "--scenarios", "8 processes, count 8, pipelined",
         "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-2000:]
    results = orjson.loads(out.read_bytes())["results"]
    assert [r["scenario"] for r in results] == [
        "submit, 8 producer(s) one-at-a-time",
        "lease+ack, 8 processes, count 8, pipelined acks",
    ]
    for r in results:
        assert r["median"] > 0, r
        extra = r["extra"]
        assert extra["server_cpu_us_per_job"] > 0 and extra["db_cpu_us_per_job"] > 0, r
        assert extra["db_xacts_per_job"] > 0, r
