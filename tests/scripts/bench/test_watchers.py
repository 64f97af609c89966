"""relay-bench --watchers keeps working: each scenario runs with no watcher, an idle one
and one of every event, and the all-events watcher accounts for every event."""

from __future__ import annotations

import subprocess

import orjson

from tests.scripts.bench.test_main import BENCH


def test_watchers_bench_runs_each_scenario_three_ways_and_counts_every_event(tmp_path):
    out = tmp_path / "watchers.json"
    finished = subprocess.run(
        [BENCH, "--watchers", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-2000:]
    results = {r["scenario"]: r for r in orjson.loads(out.read_bytes())["results"]}
    # Quick sizes: 8 x 150 one-at-a-time, 4,000 pipelined, 20 batches of 100, a backlog
    # of 3,000 leased and acked (two events each: leased, succeeded).
    submits = {
        "submit, 8 producer(s) one-at-a-time": 8 * 150,
        "submit, 1 connection pipelining (window 64)": 4_000,
        "submit_batch of 100, 1 client(s)": 2_000,
    }
    lease_ack = "lease+ack, 8 processes, count 8, pipelined acks"
    for name in [*submits, lease_ack]:
        for kind in ("none", "idle", "all"):
            r = results[f"{name}, watcher: {kind}"]
            assert len(r["runs"]) == 1 and r["median"] > 0, r
        seen = results[f"{name}, watcher: all"]["extra"]
        received = seen["events"] + seen["dropped"]  # delivered or reported lost: all
        if name in submits:
            assert received == submits[name], (name, seen)
        else:
            assert received % 2 == 0 and received >= 2 * 3_000, seen
