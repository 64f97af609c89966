"""What many queues cost ``stats`` and ``/metrics``: ``python -m relay_scripts.bench_queues``.

Starts ``relay-trio server`` (the one beside this interpreter) on a fresh SQLite file or
PostgreSQL schema, makes N queues of one ready job each (submit_batch, 1,000 at a time),
then measures, each the median of a few tries: one ``stats`` round trip, one with
``oldest_ready``, one ``/metrics`` scrape (its bytes too); and another client's submit
round trips (median and worst) while 32 ``stats`` with ``oldest_ready`` are in flight on
one connection and 4 scrapes run. Prints one JSON line per N. Used for the numbers in
docs/scaling.md and docs/security.md; runs against an older checkout too (its server then
has no --max-queues).

    python -m relay_scripts.bench_queues --queues 10000 100000 [--db postgresql://...]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

# (BENCH_RELAY: another relay-trio executable, e.g. an older checkout's, to compare)
RELAY = os.environ.get("BENCH_RELAY") or str(Path(sys.executable).parent / "relay-trio")
TRIES = 5
SCRAPES = int(os.environ.get("BENCH_SCRAPES", "4"))  # scrapes during the load


class Line:
    """One blocking connection speaking the line protocol."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")
        self.next_id = 0

    def send(self, op: str, **fields: object) -> None:
        self.next_id += 1
        self.sock.sendall(json.dumps({"op": op, "id": self.next_id, **fields}).encode() + b"\n")

    def read(self) -> dict:
        return json.loads(self.file.readline())

    def call(self, op: str, **fields: object) -> dict:
        self.send(op, **fields)
        reply = self.read()
        assert reply.get("ok"), reply
        return reply


def start(db: str, n: int) -> tuple[subprocess.Popen, int, int]:
    args = [
        RELAY,
        "server",
        "--db",
        db,
        "--address",
        "127.0.0.1:0",
        "--metrics-address",
        "127.0.0.1:0",
        "--ws-address",
        "off",
        "--max-batch",
        "1000",
        "--max-in-flight",
        "256",
    ]
    if (
        "--max-queues"
        in subprocess.run([RELAY, "server", "--help"], capture_output=True, text=True).stdout
    ):
        args += ["--max-queues", str(n + 10), "--metrics-cache-ms", "1"]
    env = dict(os.environ, RELAY_LOG_FORMAT="json", RELAY_LOG="info")
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    for line in proc.stderr:
        record = json.loads(line)
        if record.get("event") == "server.started":
            port = int(record["address"].rsplit(":", 1)[1])
            metrics = int(record["metrics"].rsplit(":", 1)[1])
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, port, metrics
    raise RuntimeError("the server did not start")


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=600) as answer:
        return answer.read()


def measure(db: str, n: int) -> dict:
    proc, port, metrics = start(db, n)
    try:
        client = Line(port)
        for begin in range(0, n, 1000):
            client.call(
                "submit_batch",
                jobs=[
                    {"queue": f"q{i:07d}", "payload": 0} for i in range(begin, min(n, begin + 1000))
                ],
            )
        stats_s = statistics.median(timed(lambda: client.call("stats")) for _ in range(TRIES))
        oldest_s = statistics.median(
            timed(lambda: client.call("stats", oldest_ready=True)) for _ in range(TRIES)
        )
        body = scrape(metrics)
        scrape_s = statistics.median(timed(lambda: scrape(metrics)) for _ in range(TRIES))
        # Another client's submits while 32 stats (oldest_ready) and 4 scrapes are in flight.
        waits: list[float] = []
        done = threading.Event()

        def submits() -> None:
            other = Line(port)
            while not done.is_set():
                waits.append(timed(lambda: other.call("submit", queue="q0000000", payload=1)))
                time.sleep(0.005)

        failures: list[str] = []

        def stats_load() -> None:
            reader = Line(port)
            try:
                for _ in range(32):
                    reader.send("stats", oldest_ready=True)
                for _ in range(32):
                    reader.read()
            except (OSError, ValueError) as exc:  # the server closed the connection
                failures.append(f"stats in flight: {type(exc).__name__}")

        def scrape_load() -> None:
            try:
                scrape(metrics)
            except OSError as exc:
                failures.append(f"scrape: {exc}")

        threads = [threading.Thread(target=stats_load)]
        threads += [threading.Thread(target=scrape_load) for _ in range(SCRAPES)]
        submitter = threading.Thread(target=submits)
        submitter.start()
        time.sleep(0.2)
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        done.set()
        submitter.join()
        return {
            "queues": n, "stats_ms": round(stats_s * 1000, 1),
            "stats_oldest_ms": round(oldest_s * 1000, 1), "scrape_ms": round(scrape_s * 1000, 1),
            "scrape_bytes": len(body), "submit_under_load_median_ms":
            round(statistics.median(waits) * 1000, 1), "submit_under_load_max_ms":
            round(max(waits) * 1000, 1), "failures": failures,
        }  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queues", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--db", help="a postgresql:// URL (a fresh schema is made in it)")
    args = parser.parse_args()
    for n in args.queues:
        with tempfile.TemporaryDirectory() as tmp:
            db = str(Path(tmp) / "queues.db")
            if args.db:
                import psycopg

                schema = f"queues_{secrets.token_hex(4)}"
                with psycopg.connect(args.db, autocommit=True) as conn:
                    conn.execute(f"CREATE SCHEMA {schema}")
                db = (
                    args.db
                    + ("&" if "?" in args.db else "?")
                    + (f"options=-csearch_path%3D{schema}")
                )
            print(json.dumps({"store": "postgres" if args.db else "sqlite", **measure(db, n)}),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
