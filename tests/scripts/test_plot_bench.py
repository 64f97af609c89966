"""plot_bench reads relay-bench's JSON: the scaling curve and the latency rows."""

from __future__ import annotations

from relay_scripts import plot_bench


def test_plot_helpers_pick_the_scaling_curve_and_latencies():
    results = [
        {"scenario": "lease+ack, relay.Worker concurrency 16", "unit": "jobs/s",
         "median": 30.0, "runs": [20.0, 30.0, 40.0], "extra": {}},
        {"scenario": "lease+ack, relay.Worker concurrency 1", "unit": "jobs/s",
         "median": 10.0, "runs": [10.0], "extra": {}},
        {"scenario": "end-to-end latency at 2,000 jobs/s offered", "unit": "ms",
         "median": 5.0, "runs": [5.0], "extra": {"ack_p99_ms": 5.0}},
    ]  # fmt: skip
    assert plot_bench.scaling_points(results) == [(1, 10.0, 10.0, 10.0), (16, 30.0, 20.0, 40.0)]
    assert plot_bench.latency_rows(results) == [
        ("end-to-end latency at 2,000 jobs/s offered", {"ack_p99_ms": 5.0})
    ]
