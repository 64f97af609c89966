"""The counts per queue kept in memory (relay/store/view.py, relay/store/counts.py), on both
stores: published after a commit and never before it, taken back by no rollback since they
were never shown; pages by name; the bound on queues checked against them."""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay.protocol.errors import QueueFull, TooManyQueues
from relay.protocol.model import SubmitSpec
from relay.store.base import Store, StoreConfig
from relay.store.postgres import PostgresStore
from relay.store.postgres import base as postgres_base
from relay.store.sqlite import SqliteStore
from relay.store.view import STATES, QueueView
from tests.conftest import T0

READY = STATES.index("ready")


@pytest.fixture(params=["sqlite", "postgres"])
def open_store(request, tmp_path) -> Iterator:
    """Opens stores of one kind on one database (as servers sharing it would)."""
    opened: list[Store] = []
    url = None
    if request.param == "postgres":
        pg_url = request.getfixturevalue("pg_url")
        schema = f"v_{secrets.token_hex(4)}"
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        url = make_conninfo(pg_url, options=f"-c search_path={schema}")

    def make(config: StoreConfig | None = None) -> Store:
        store: Store
        if url is None:
            store = SqliteStore.open(str(tmp_path / "v.db"), config, rng=random.Random(1))
        else:
            store = PostgresStore.open(url, config, rng=random.Random(len(opened)))
        opened.append(store)
        return store

    try:
        yield make
    finally:
        for store in opened:
            store.close()


def submit(store: Store, *queues: str) -> None:
    store.begin()
    store.jobs_submit([SubmitSpec(queue, "1") for queue in queues], T0)
    store.commit()


def test_counts_are_published_at_commit_not_before_and_not_after_a_rollback(open_store):
    store = open_store()
    store.begin()
    store.jobs_submit([SubmitSpec("a", "1"), SubmitSpec("a", "2")], T0)
    assert store.view.get("a") is None  # not committed yet
    store.commit()
    entry = store.view.get("a")
    assert entry is not None and entry[READY] == 2 and len(store.view) == 1
    store.begin()
    store.jobs_submit([SubmitSpec("a", "3"), SubmitSpec("b", "1")], T0)
    store.rollback()
    assert store.view.get("a") == entry and "b" not in store.view
    # A queue left with no jobs leaves the view.
    store.begin()
    [lease] = store.jobs_claim(["a"], "w", 1, 1_000, T0)
    store.jobs_fail(lease.job_id, "w", lease.token, "no", False, T0)
    assert store.dead_purge(lease.job_id) == 1
    store.commit()
    store.begin()
    [lease] = store.jobs_claim(["a"], "w", 1, 1_000, T0)
    store.jobs_fail(lease.job_id, "w", lease.token, "no", False, T0)
    store.dead_purge(lease.job_id)
    store.commit()
    assert "a" not in store.view and len(store.view) == 0


def test_a_reopened_store_publishes_what_the_database_holds(open_store):
    first = open_store()
    submit(first, "x", "y", "y")
    first.close()  # (a SQLite file has one store at a time)
    again = open_store()
    rows, after = again.view.page(None, 10)
    assert [(queue, entry[READY]) for queue, entry in rows] == [("x", 1), ("y", 2)]
    assert after is None


def test_max_queues_refuses_a_new_queue_and_takes_jobs_for_the_others(open_store):
    store = open_store(StoreConfig(max_queues=2))
    submit(store, "a", "b")
    with pytest.raises(TooManyQueues, match=r"2 queues hold jobs \(max 2\)") as refused:
        submit(store, "a", "c")
    assert isinstance(refused.value, QueueFull) and refused.value.code == "too_many_queues"
    store.rollback()
    assert store.view.get("a")[READY] == 1  # type: ignore[index]
    submit(store, "a", "b", "b")
    # Queues that the same transaction creates count before it commits.
    store.config = StoreConfig(max_queues=3)
    store.begin()
    store.jobs_submit([SubmitSpec("c", "1")], T0)
    with pytest.raises(TooManyQueues):
        store.jobs_submit([SubmitSpec("d", "1")], T0)
    store.commit()
    assert len(store.view) == 3


def test_pages_go_by_name_and_only_names_what_is_asked():
    view = QueueView()
    zeros = (0,) * (len(STATES) + 7)
    view.publish([(f"q{i}", (1, *zeros[1:])) for i in (3, 1, 2, 5, 4)])
    assert view.page(None, 2) == ([("q1", view.get("q1")), ("q2", view.get("q2"))], "q2")
    assert [q for q, _ in view.page("q2", 2)[0]] == ["q3", "q4"]
    assert view.page("q4", 2) == ([("q5", view.get("q5"))], None)
    assert view.page(None, 5, only=["q9", "q1"]) == ([("q1", view.get("q1")), ("q9", None)], None)
    view.publish([("q1", None), ("q3", None)])
    assert [q for q, _ in view.page(None, 10)[0]] == ["q2", "q4", "q5"]
    rows, sums = view.top(2)
    assert [q for q, _ in rows] == ["q2", "q4"] and sums[0] == 3
    text, ready, after, _paused = view.page_json(None, 2)
    assert text.startswith(b'{"q2":{"pending":1,') and ready == [] and after == "q4"


def test_postgres_follows_the_counts_of_another_server_a_page_at_a_time(pg_url, monkeypatch):
    # (pages of a few rows, so that three queues take two pages)
    monkeypatch.setattr(postgres_base, "_MIN_PAGE_ROWS", 1)
    schema = f"f_{secrets.token_hex(4)}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    url = make_conninfo(pg_url, options=f"-c search_path={schema}")
    a, b = PostgresStore.open(url, slot=1), PostgresStore.open(url, slot=2)
    try:
        submit(a, "p1", "p2", "p3")
        submit(b, "p2")
        assert a.view.get("p2")[READY] == 1  # type: ignore[index]  # b's job not seen yet
        # One page of two queues, then the last page, read in a's writer transactions.
        a.begin()
        after = a.counts_refresh(None, 1)  # 4 rows: p1, p2 twice (two slots), p3
        a.commit()
        assert after == "p2" and a.view.get("p2")[READY] == 2  # type: ignore[index]
        b.begin()
        [lease] = b.jobs_claim(["p3"], "w", 1, 1_000, T0)
        b.jobs_fail(lease.job_id, "w", lease.token, "no", False, T0)
        b.dead_purge(lease.job_id)
        b.commit()
        a.begin()
        assert a.counts_refresh(after, 1) is None
        a.commit()
        assert "p3" not in a.view and len(a.view) == 2
    finally:
        a.close()
        b.close()
