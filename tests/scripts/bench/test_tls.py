"""relay-bench --tls keeps working: the submit scenarios run against a plain server and a
TLS one (its certificate made with the openssl command), and both are reported."""

from __future__ import annotations

import shutil
import subprocess

import orjson
import pytest

from tests.scripts.bench.test_main import BENCH

TLS_SCENARIOS = [
    "submit, 1 producer(s) one-at-a-time",
    "submit, 8 producer(s) one-at-a-time",
    "submit, 1 connection pipelining (window 64)",
]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_quick_tls_bench_reports_each_scenario_with_and_without_tls(tmp_path):
    out = tmp_path / "bench.json"
    finished = subprocess.run(
        [BENCH, "--quick", "--tls", "--sync", "full", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-2000:]
    results = orjson.loads(out.read_bytes())["results"]
    names = [r["scenario"] for r in results]
    assert names == TLS_SCENARIOS + [f"{name}, TLS" for name in TLS_SCENARIOS]
    for r in results:
        assert r["sync"] == "full" and len(r["runs"]) == 1 and r["median"] > 0, r
        assert r["mean_batch"] >= 1, r  # a real server committed them


def test_tls_bench_starts_its_own_servers():
    finished = subprocess.run(
        [BENCH, "--tls", "--address", "127.0.0.1:7400"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert finished.returncode == 2
    assert "--tls starts its own servers" in finished.stderr
