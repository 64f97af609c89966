"""Shared fixtures. The store is synchronous: tests drive it with explicit ``now`` values."""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator

import pytest

from relay.store.base import StoreConfig
from relay.store.sqlite import SqliteStore
from tests import pg

# Fixtures shared by the top-level test modules (a plugin's fixtures give way to any
# conftest's of the same name, so tests/server and tests/cli keep their own `server`).
pytest_plugins = ["tests.worker.helpers"]

# A fixed instant (2026-01-01T00:00:00Z) to start test clocks from.
T0 = 1_767_225_600_000


def common_start(a: str, b: str) -> str:
    """The longest start that two different job ids share: an abbreviation of both."""
    return a[: next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)]


def assert_abbreviated_as_git_does(every: list[str], asked: list[str], shown: list[str]):
    """Each of ``shown`` is the start of its id of ``asked`` that only that id of ``every``
    (all the store's ids) begins with, "job_" and 7 digits at least, and one digit fewer
    would not be (git's abbreviation); an id of no job is shown whole."""
    known, every = set(every), sorted(every)

    def beginning(start: str) -> int:  # how many of every begin so
        return bisect.bisect_left(every, start + "g") - bisect.bisect_left(every, start)

    assert len(shown) == len(asked)
    for job_id, short in zip(asked, shown, strict=True):
        if job_id not in known:
            assert short == job_id
            continue
        assert job_id.startswith(short) and len(short) >= len("job_") + 7, (job_id, short)
        assert beginning(short) == 1, (job_id, short)
        if len(short) > len("job_") + 7:
            assert beginning(short[:-1]) > 1, (job_id, short)


@pytest.fixture
def store() -> Iterator[SqliteStore]:
    """A fresh in-memory store whose jitter comes from a seeded generator."""
    s = SqliteStore.open(":memory:", StoreConfig(), rng=random.Random(1234))
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """The URL of this run's own PostgreSQL database (tests/pg.py), made on first use and
    dropped at the end of the run. Fails, never skips, where PostgreSQL does not answer."""
    with pg.run_database() as url:
        yield url


async def answer_hello(stream) -> None:
    """Play a relay-trio server for a client's first line, its hello (every connection of
    the clients begins with one): for fake servers that then misbehave."""
    import orjson

    data = b""
    while b"\n" not in data:
        more = await stream.receive_some(65536)
        assert more, "the client closed before its hello"
        data += more
    assert orjson.loads(data.split(b"\n", 1)[0])["op"] == "hello"
    hello = {"id": 0, "ok": True, "server": "relay-trio", "version": "test", "protocol": 1}
    await stream.send_all(orjson.dumps(hello) + b"\n")
