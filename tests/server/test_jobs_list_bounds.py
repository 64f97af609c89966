"""What one ``jobs_list`` may cost the server, over real sockets, on both stores: a page of
every queue at many queues, and a search by an id's start, examine a bounded number of
jobs (a short page then says where to go on with its cursor); a page's reply bytes are
reserved, so a client that sends many and reads none is no longer read; and ``history``
refuses a ``from`` after now as it refuses one after ``to`` (docs/protocol.md).

The bounds are made small here (rows.py's MERGED_RUNS_MAX and ROWS_EXAMINED_MAX, read per
page), so that a few hundred jobs cross them.
"""

from __future__ import annotations

import os
import sqlite3
from typing import Any

import orjson
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from relay.server.connections import session as session_module
from relay.store import rows as rows_module
from relay.store.sqlite.browse import SqliteBrowse
from tests.server.conftest import BOUND_S, LineClient, RunningServer, writer_barrier
from tests.server.connections.test_session import open_raw, pipelined, request_count
from tests.server.test_protocol import (
    assert_error,
    connected,
    custom_server,
    server,  # noqa: F401 (a fixture: both stores)
    well_behaved_round,
)

DAY = 86_400_000


@pytest.fixture
def small_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rows_module, "MERGED_RUNS_MAX", 4, raising=False)
    monkeypatch.setattr(rows_module, "ROWS_EXAMINED_MAX", 50, raising=False)


async def submit_batch(c: LineClient, jobs: list[dict[str, Any]]) -> list[str]:
    reply = await c.ok("submit_batch", jobs=jobs)
    return [job["job_id"] for job in reply["results"]]


def joined(pages: list[list[str]]) -> list[str]:
    return [job for page in pages for job in page]


async def pages(c: LineClient, limit: int, **fields: Any) -> list[list[str]]:
    """The job ids of every page of jobs_list with ``fields``, following its cursor."""
    found, cursor = [], None
    for _ in range(100):
        args = {**fields, "limit": limit}
        if cursor is not None:
            args["cursor"] = cursor
        reply = await c.ok("jobs_list", **args)
        assert len(reply["jobs"]) <= limit
        found.append([job["job_id"] for job in reply["jobs"]])
        cursor = reply["next_cursor"]
        if cursor is None:
            return found
    raise AssertionError("no last page")


async def test_a_page_of_every_queue_at_many_queues_examines_a_bounded_number_of_jobs(
    server: RunningServer,  # noqa: F811
    small_bounds: None,
):
    """20 queues hold a delayed job each, then 200 ready jobs newer than them: more
    (queue, state) than are merged, so a page of every queue reads the jobs by id, at most
    ROWS_EXAMINED_MAX of them. The first page of pending jobs, newest first, finds none
    among the 50 newest: it is empty, and its cursor goes on; the cursors then give each
    pending job once, newest first."""
    async with connected(server) as c:
        queues = [f"q{i:02d}" for i in range(20)]
        delayed = [{"queue": q, "payload": {}, "delay_ms": DAY} for q in queues]
        pending = await submit_batch(c, delayed)
        await submit_batch(c, [{"queue": q, "payload": {}} for q in queues for _ in range(10)])

        first = await c.ok("jobs_list", states=["pending"], limit=10)
        assert first["jobs"] == [] and first["next_cursor"] is not None, first

        got = await pages(c, 10, states=["pending"])
        assert len(got) <= 220 // 50 + 2, got  # (each page examined up to 50 jobs)
        assert joined(got) == pending[::-1]
        # Every state: full pages, each job once, oldest first too.
        every = await pages(c, 100, order="oldest")
        assert joined(every) == sorted(joined(every)) and len(joined(every)) == 220


async def test_a_page_of_one_queue_or_of_the_dead_of_every_queue_is_full(
    server: RunningServer,  # noqa: F811
    small_bounds: None,
):
    """Pages that read an index of their own jobs need no bound on the jobs examined: a
    queue's (a run per state), and every queue's dead ones (their index by id)."""
    async with connected(server) as c:
        queues = [f"q{i:02d}" for i in range(20)]
        pending = await submit_batch(c, [{"queue": "a", "payload": {}, "delay_ms": DAY}] * 3)
        await submit_batch(c, [{"queue": q, "payload": {}} for q in queues for _ in range(10)])
        reply = await c.ok("jobs_list", queue="a", states=["pending"], limit=10)
        assert [job["job_id"] for job in reply["jobs"]] == pending[::-1]
        assert reply["next_cursor"] is None
        reply = await c.ok("jobs_list", states=["dead"], limit=10)
        assert reply == {**reply, "jobs": [], "next_cursor": None}


async def test_a_search_by_an_id_start_examines_a_bounded_number_of_jobs(
    server: RunningServer,  # noqa: F811
    small_bounds: None,
):
    """200 jobs of one id range, none dead: a search of the dead among them reads at most
    50 a page, so its pages are empty until the range is read; every state's pages give
    each job once."""
    async with connected(server) as c:
        ids = await submit_batch(c, [{"queue": "s", "payload": {}}] * 200)
        prefix = os.path.commonprefix(ids)  # noqa: RUF071 (characters, not paths)
        assert len(prefix) >= len("job_") + 7, ids  # (one batch: one millisecond's ids)

        first = await c.ok("jobs_list", states=["dead"], search=prefix, limit=10)
        assert first["jobs"] == [] and first["next_cursor"] is not None, first
        got = await pages(c, 10, states=["dead"], search=prefix)
        assert joined(got) == [] and len(got) <= 200 // 50 + 2, got

        every = await pages(c, 30, search=prefix, order="oldest")
        assert joined(every) == ids
        every = await pages(c, 30, queue="s", search=prefix)
        assert joined(every) == ids[::-1]


async def test_the_work_of_a_page_of_every_queue_does_not_grow_with_the_queues(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """SQLite's work for one jobs_list of every queue, counted in virtual machine
    instructions (no clock): at 2,000 queues holding jobs, no more than twice its work at 40, with
    ROWS_EXAMINED_MAX made small so that both cross it. (A seek per queue and state held
    made it grow with the queues: 2,000 queues took seconds in the writer.)"""
    monkeypatch.setattr(rows_module, "ROWS_EXAMINED_MAX", 200, raising=False)
    steps: list[int] = []
    jobs_list = SqliteBrowse.jobs_list

    def counted(self: SqliteBrowse, *args: Any, **kwargs: Any) -> Any:
        db: sqlite3.Connection = self._db
        count = [0]

        def step() -> int:
            count[0] += 1
            return 0

        db.set_progress_handler(step, 1)
        try:
            return jobs_list(self, *args, **kwargs)
        finally:
            db.set_progress_handler(None, 0)
            steps.append(count[0])

    monkeypatch.setattr(SqliteBrowse, "jobs_list", counted)
    work = {}
    async with custom_server(tmp_path) as srv, connected(srv) as c:
        for queues, each in ((40, 5), (2_000, 1)):  # (past 200 jobs either way)
            for start in range(0, queues, 500):
                names = [f"n{queues}-{i}" for i in range(start, min(queues, start + 500))]
                ready = [{"queue": q, "payload": {}} for q in names for _ in range(each)]
                await submit_batch(c, ready)
                delayed = [{"queue": q, "payload": {}, "delay_ms": DAY} for q in names]
                await submit_batch(c, delayed)
            steps.clear()
            reply = await c.ok("jobs_list", limit=50, states=["pending", "ready", "dead"])
            assert len(reply["jobs"]) == 50
            work[queues] = steps[0]
    assert 0 < work[2_000] <= 2 * work[40], work


async def big_page_jobs(c: LineClient, queue: str) -> None:
    """100 leased jobs of ``queue`` whose summaries are near their largest: a long
    idempotency key and worker id each (a page of them is ~75 KB)."""
    jobs = [{"queue": queue, "payload": {}, "idempotency_key": f"{i:03d}" + "k" * 253}
            for i in range(100)]  # fmt: skip
    await submit_batch(c, jobs)
    reply = await c.ok("lease", queues=[queue], worker_id="w" * 256, count=100, lease_ms=600_000)
    assert len(reply["jobs"]) == 100


async def test_reading_stops_while_the_jobs_list_replies_owed_reach_max_owed_bytes(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    """256 jobs_list pages of 100 big summaries (~19 MB of replies) from a client that
    reads none: each reserves its most until answered, so the reader stops at
    MAX_OWED_BYTES rather than taking all 256 (max_in_flight) at once, while others are
    served."""
    monkeypatch.setattr(session_module, "MAX_OWED_BYTES", 3 * 1024 * 1024)
    async with custom_server(tmp_path) as srv, connected(srv) as good:
        await big_page_jobs(good, "big")
        page = await good.ok("jobs_list", queue="big", limit=100)
        assert len(page["jobs"]) == 100 and 70_000 < len(orjson.dumps(page)) < 80_000
        stalled = await open_raw(srv)
        try:
            request = {"op": "jobs_list", "queue": "big", "limit": 100}
            data = pipelined([{**request, "id": i} for i in range(256)])
            with trio.fail_after(BOUND_S):
                await stalled.send(data)  # (~14 KB: it fits in the socket buffers)
            await wait_all_tasks_blocked()
            await writer_barrier(good)  # the writer answered what the reader took before this
            answered = await request_count(srv, "jobs_list")
            assert 1 <= answered < 200, answered
            await well_behaved_round(good, "good")  # others are served meanwhile
        finally:
            stalled.close()


async def test_history_from_after_now_without_to_is_refused_as_after_to(
    server: RunningServer,  # noqa: F811
):
    async with connected(server) as c:
        reply = await c.ok("history")
        later = reply["to"] + DAY
        for fields in ({"from": later}, {"from": later, "to": later - 60_000}):
            error = assert_error(await c.request("history", **fields), "bad_request")
            assert error["message"] == "from: must be before to", error
