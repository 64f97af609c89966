"""bench_floor keeps working: every transaction runs the three ways, each lease+ack acks
what the one before claimed (the script asserts it), and its databases are dropped
after. (Speed is the benchmark's business: no number is asserted but that each ran.)"""

from __future__ import annotations

import subprocess
import sys

import orjson
import psycopg

from tests import pg


def test_bench_floor_runs_every_transaction_three_ways_and_drops_its_databases(pg_url):
    url = pg.server_url(pg_url)
    finished = subprocess.run(
        [sys.executable, "-m", "relay_scripts.bench_floor", "--db", url, "--rounds", "1",
         "--seconds", "0.05", "--backlog", "2000", "--sizes", "1,3", "--claims", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert finished.returncode == 0, finished.stderr[-2000:]
    report = orjson.loads(finished.stdout)
    assert list(report) == ["submit 1", "submit 3", "lease+ack 2"]
    for transaction, ways in report.items():
        assert list(ways) == ["sqlite", "postgres", "floor"], transaction
        assert all(way["us"] > 0 for way in ways.values()), (transaction, ways)
        assert ways["sqlite"]["db_cpu_us"] == 0, (transaction, ways)  # (no database process)
    with psycopg.connect(url, autocommit=True) as admin:
        left = admin.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'relay\\_bench\\_%'"
        ).fetchall()
    assert left == []  # (relay-bench's fresh databases, PgDatabase: none left)
