"""Each command of the console script, run as a subprocess against a real server."""

from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import textwrap
from pathlib import Path

import orjson
import trio

import relay
from relay import JobState
from relay.client.client import Client
from tests.conftest import common_start

from .conftest import (
    BOUND_S,
    COMMAND_TIMEOUT_S,
    RELAY,
    Result,
    assert_one_line_error,
    cli_env,
    relay_trio,
    relay_trio_sync,
)

WORKER = "test-worker"


async def make_dead(client: Client, queue: str, error: str) -> str:
    """A dead job: submitted, leased and failed as not retryable."""
    submitted = await client.submit(queue, {"doomed": True})
    (job,) = await client.lease([queue], WORKER)
    assert job.job_id == submitted.job_id
    await client.fail(job.job_id, WORKER, job.token, error, retryable=False)
    return job.job_id


async def wait_for_states(client: Client, job_ids: list[str], *states: JobState) -> None:
    with trio.fail_after(BOUND_S):
        while True:
            jobs = [await client.inspect(job_id) for job_id in job_ids]
            if all(job.state in states for job in jobs):
                return
            await trio.sleep(0.05)


# -- submit, inspect, stats ---------------------------------------------------------------


async def test_submit_prints_id_and_state_and_honours_every_option(address, client):
    args = [
        "submit",
        "email",
        "--payload",
        '{"to": "ada@example.com"}',
        "--priority",
        "high",
        "--retries",
        "5",
        "--backoff",
        "exp:200:5000:nojitter",
        "--idempotency-key",
        "k1",
    ]
    first = await relay_trio(*args, address=address)
    assert first.code == 0, first
    job_id, state = first.stdout.split()
    assert job_id.startswith("job_") and state == "ready"
    again = await relay_trio(*args, address=address)
    assert again.stdout.split() == [job_id, "ready", "duplicate"]

    job = await client.inspect(job_id)
    assert job.payload == {"to": "ada@example.com"}
    assert job.priority == "high" and job.max_attempts == 6 and job.idempotency_key == "k1"


async def test_submit_with_a_unique_key_prints_the_holder_as_duplicate(address, client):
    args = ["submit", "reports", "--payload", "1", "--unique-key", "day-7"]
    first = await relay_trio(*args, address=address)
    assert first.code == 0, first
    job_id, state = first.stdout.split()
    again = await relay_trio(*args, "--unique-for", "unfinished", address=address)
    assert again.stdout.split() == [job_id, state, "duplicate"]
    alone = await relay_trio("submit", "reports", "--payload", "1", "--unique-for", "queued",
                             address=address)  # fmt: skip
    assert alone.code == 2 and "--unique-for needs --unique-key" in alone.stderr
    assert len(alone.stderr.strip().splitlines()) == 1 and "Traceback" not in alone.stderr
    assert (await client.stats()).queues["reports"]["ready"] == 1


async def test_submit_reads_the_payload_from_stdin_and_prints_json(address, client):
    result = await relay_trio("submit", "reports", "--payload", "-", "--delay-ms", "60000",
                              "--backoff", "fixed:250", "--json", address=address,
                              stdin='{"report": [1, 2, 3]}\n')  # fmt: skip
    assert result.code == 0, result
    reply = result.json()
    assert set(reply) == {"job_id", "state", "duplicate"}
    assert reply["state"] == "pending" and reply["duplicate"] is False
    job = await client.inspect(reply["job_id"])
    assert job.payload == {"report": [1, 2, 3]} and job.state == JobState.PENDING


async def test_submit_with_a_timeout_and_inspect_shows_it(address, client):
    result = await relay_trio("submit", "reports", "--payload", "1", "--timeout-ms", "90000",
                              address=address)  # fmt: skip
    assert result.code == 0, result
    job_id = result.stdout.split()[0]
    assert (await client.inspect(job_id)).timeout_ms == 90_000
    panel = await relay_trio("inspect", job_id, address=address)
    assert "timeout" in panel.stdout and "1m 30s per attempt" in panel.stdout
    bad = await relay_trio("submit", "reports", "--payload", "1", "--timeout-ms", "0",
                           address=address)  # fmt: skip
    assert bad.code == 2 and "--timeout-ms" in bad.stderr and "Traceback" not in bad.stderr


async def test_inspect_shows_the_job_as_a_panel_and_as_json(address, client):
    job_id = await make_dead(client, "payments", "card declined")
    panel = await relay_trio("inspect", job_id, address=address)
    assert panel.code == 0, panel
    for fragment in (job_id, "dead", "payments", "normal", "1 of 4", "card declined",
                     '"doomed": true', " UTC", WORKER):  # fmt: skip
        assert fragment in panel.stdout, fragment

    as_json = (await relay_trio("inspect", job_id, "--json", address=address)).json()
    assert as_json["job_id"] == job_id and as_json["state"] == "dead"
    assert as_json["errors"] == [
        {
            "attempt": 1,
            "error": "card declined",
            "at": as_json["errors"][0]["at"],
            "traceback": None,
        }
    ]
    # The attempt history: the one attempt, failed on WORKER, in the panel's timeline too.
    [attempt] = as_json["attempts"]
    assert (attempt["attempt"], attempt["outcome"], attempt["worker_id"]) == (1, "failed", WORKER)
    assert attempt["error"] == "card declined" and as_json["attempts_dropped"] == 0
    timeline = [line for line in panel.stdout.splitlines() if " failed " in line]
    assert len(timeline) == 1 and WORKER in timeline[0] and "card declined" in timeline[0]
    assert " ms " in timeline[0] or " s " in timeline[0]  # how long it took
    # Stable keys: every field of the job, present or null.
    assert {"result", "run_at", "lease_expires_at", "idempotency_key"} <= set(as_json)
    assert as_json["result"] is None


async def test_stats_shows_queues_by_state_with_totals(address, client):
    for n in range(3):
        await client.submit("email", {"n": n})
    await client.submit("images", {"n": 0}, delay_ms=60_000)
    await make_dead(client, "images", "boom")

    table = await relay_trio("stats", address=address)
    assert table.code == 0, table
    lines = table.stdout.splitlines()
    email = next(line for line in lines if "email" in line)
    assert [w for w in email.split() if w.isdigit()][:7] == ["0", "3", "0", "0", "0", "0", "3"]
    # The last column: how long the oldest of its 3 ready jobs has waited.
    assert re.search(r"\d+(\.\d)? m?s\s*$", email.rstrip("│ ")), email
    images = next(line for line in lines if "images" in line)
    assert [w for w in images.split() if w.isdigit()] == ["1", "0", "0", "0", "0", "1", "2"]
    assert images.rstrip("│ ").endswith("-"), images  # none ready
    total = next(line for line in lines if "total" in line and "pending" not in line)
    assert [w for w in total.split() if w.isdigit()] == ["1", "3", "0", "0", "0", "1", "5"]
    assert "relay-trio 0.1.0" in table.stdout and "connection" in table.stdout

    as_json = (await relay_trio("stats", "--json", address=address)).json()
    assert list(as_json) == [
        "queues", "server", "oldest_ready_ms", "next_cursor", "total_queues", "paused",
    ]  # fmt: skip
    assert as_json["paused"] == []
    assert list(as_json["queues"]) == ["email", "images"]
    assert set(as_json["oldest_ready_ms"]) == {"email"}  # images has no ready job
    assert as_json["queues"]["email"]["ready"] == 3 and as_json["queues"]["images"]["dead"] == 1
    assert set(as_json["server"]) == {"version", "uptime_ms", "connections"}
    assert as_json["next_cursor"] is None and as_json["total_queues"] == 2

    # Only the queues named (a page of the server's queues by name, else).
    only = (await relay_trio("stats", "--queue", "images", "--json", address=address)).json()
    assert list(only["queues"]) == ["images"] and only["total_queues"] == 2


# -- queues -------------------------------------------------------------------------------


async def test_queue_pause_then_list_shows_it_paused_and_resume_lets_it_lease(address, client):
    job_id = (await client.submit("email", {"n": 1})).job_id
    await client.submit("images", {"n": 2})
    paused = await relay_trio("queue", "pause", "email", address=address)
    assert paused.code == 0 and paused.stderr == "", paused
    assert "paused queue email" in paused.stdout
    assert await client.lease(["email"], WORKER) == []
    later = await relay_trio("queue", "pause", "later", "--json", address=address)
    assert later.json() == {"queue": "later", "paused": True}

    table = await relay_trio("queue", "list", address=address)
    assert table.code == 0, table
    lines = table.stdout.splitlines()
    email = next(line for line in lines if "email" in line).split()
    assert email == ["email", "paused", "0", "1", "0", "0", "0", "0", "1"]
    assert next(line for line in lines if "images" in line).split()[1] == "-"
    assert next(line for line in lines if "later" in line).split()[1] == "paused"
    as_json = (await relay_trio("queue", "list", "--limit", "2", "--json", address=address)).json()
    assert [(q["queue"], q["paused"]) for q in as_json["queues"]] == [
        ("email", True), ("images", False),
    ]  # fmt: skip
    assert as_json["queues"][0]["counts"]["ready"] == 1 and as_json["next_cursor"] == "images"
    rest = await relay_trio("queue", "list", "--cursor", "images", "--json", address=address)
    assert [q["queue"] for q in rest.json()["queues"]] == ["later"]
    stats = await relay_trio("stats", address=address)
    assert "email paused" in stats.stdout and "images paused" not in stats.stdout
    assert (await relay_trio("stats", "--json", address=address)).json()["paused"] == ["email"]

    resumed = await relay_trio("queue", "resume", "email", address=address)
    assert resumed.code == 0 and "resumed queue email" in resumed.stdout, resumed
    assert [job.job_id for job in await client.lease(["email"], WORKER)] == [job_id]


async def test_queue_commands_refuse_a_bad_name_or_page_in_one_line(address, client):
    for args in (["pause", "no spaces"], ["resume", "x" * 129], ["pause"]):
        result = await relay_trio("queue", *args, address=address)
        assert_one_line_error(result, code=2)
    assert_one_line_error(
        await relay_trio("queue", "pause", "a/b", address=address), "a/b", "queue name", code=2
    )
    assert_one_line_error(
        await relay_trio("queue", "list", "--limit", "0", address=address), "--limit", code=2
    )
    assert_one_line_error(
        await relay_trio("queue", "list", "--cursor", "no spaces", address=address), "cursor",
        code=2,
    )  # fmt: skip
    assert (await client.queue_list()).queues == []  # nothing was paused


def row_of(lines: list[str], queue: str) -> str:
    return next(line for line in lines if line.startswith(queue + " "))


async def test_queue_set_changes_some_settings_and_show_and_list_show_them(address, client):
    await client.submit("email", {"n": 1})
    done = await relay_trio("queue", "set", "email", "--max-leased", "5", "--rate", "100/s",
                            "--default-timeout", "30s", "--default-backoff", "exp:1s:5m",
                            address=address)  # fmt: skip
    assert done.code == 0 and done.stderr == "", done
    assert "5 jobs at once" in done.stdout and "100/s" in done.stdout, done.stdout
    assert "30s" in done.stdout and "exp:1s:5m" in done.stdout
    config = await client.queue_config("email")
    assert (config.max_leased, config.rate, config.default_timeout_ms) == (
        5, {"limit": 100, "period_ms": 1000}, 30_000,
    )  # fmt: skip
    assert config.default_backoff == {
        "kind": "exponential", "base_ms": 1000, "max_ms": 300_000, "jitter": True,
    }  # fmt: skip

    # Only what is given changes; none clears.
    cleared = await relay_trio("queue", "set", "email", "--rate", "none", "--default-retries",
                               "0", "--json", address=address)  # fmt: skip
    assert cleared.code == 0, cleared
    as_json = cleared.json()
    assert as_json["rate"] is None and as_json["default_retries"] == 0
    assert as_json["max_leased"] == 5 and as_json["default_timeout_ms"] == 30_000

    shown = await relay_trio("queue", "show", "email", address=address)
    assert shown.code == 0, shown
    assert "email" in shown.stdout and "5 jobs at once" in shown.stdout
    assert "- (no limit)" in shown.stdout  # the rate, cleared
    counts = shown.stdout.splitlines()
    header = next(i for i, line in enumerate(counts) if "pending" in line)
    assert counts[header + 2].split()[1:4] == ["0", "1", "0"]  # (the panel's border first)
    info = (await relay_trio("queue", "show", "email", "--json", address=address)).json()
    assert info["counts"]["ready"] == 1 and info["max_leased"] == 5
    # A queue without jobs or settings is shown with none.
    empty = (await relay_trio("queue", "show", "nothing", "--json", address=address)).json()
    assert empty["max_leased"] is None and sum(empty["counts"].values()) == 0

    table = await relay_trio("queue", "list", address=address)
    lines = table.stdout.splitlines()
    assert lines[1].split()[:4] == ["queue", "paused", "limits", "defaults"], lines
    assert row_of(lines, "email").split()[:6] == ["email", "-", "max", "5", "30s", "·"]
    assert "0 retries · exp:1s:5m" in row_of(lines, "email")
    # stats marks a queue with a limit (asking queue_list); its --json is the stats reply.
    stats = await relay_trio("stats", address=address)
    assert "email limited" in stats.stdout, stats
    assert "limited" not in (await relay_trio("stats", "--json", address=address)).stdout


async def test_queue_set_refuses_no_setting_and_bad_values_in_one_line(address, client):
    assert_one_line_error(
        await relay_trio("queue", "set", "email", address=address), "--max-leased", code=2
    )
    for option, value in (
        ("--rate", "100"),
        ("--max-leased", "0"),
        ("--default-timeout", "5x"),
        ("--default-backoff", "linear:1s"),
        ("--default-retries", "-1"),
    ):
        result = await relay_trio("queue", "set", "email", option, value, address=address)
        assert_one_line_error(result, option, code=2)
    # What only the server checks: bad_request naming the field, exit 2.
    result = await relay_trio("queue", "set", "email", "--rate", "1/2d", address=address)
    assert_one_line_error(result, "bad_request", "rate.period_ms", code=2)
    assert (await client.queue_list()).queues == []  # nothing was set


# -- dead letters -------------------------------------------------------------------------


async def test_dead_list_retry_and_purge(address, client):
    a1 = await make_dead(client, "alpha", "card declined")
    a2 = await make_dead(client, "alpha", "x" * 200)
    b1 = await make_dead(client, "beta", "410 Gone")

    listed = await relay_trio("dead", "list", "--full", address=address)
    assert listed.code == 0, listed
    for job_id in (a1, a2, b1):
        assert job_id in listed.stdout
    assert "card declined" in listed.stdout and "410 Gone" in listed.stdout
    # The error fills the rest of the line (COLUMNS=200), cut with an ellipsis.
    (long_row,) = [line for line in listed.stdout.splitlines() if "xxx" in line]
    assert len(long_row) == 200 and long_row.endswith("x…"), long_row

    page = (await relay_trio("dead", "list", "--queue", "alpha", "--limit", "1", "--json",
                             address=address)).json()  # fmt: skip
    assert [job["job_id"] for job in page["jobs"]] == [a2]
    assert page["next_cursor"] is not None
    rest = (await relay_trio("dead", "list", "--queue", "alpha", "--cursor",
                             page["next_cursor"], "--json", address=address)).json()  # fmt: skip
    assert [job["job_id"] for job in rest["jobs"]] == [a1] and rest["next_cursor"] is None

    retried = await relay_trio("dead", "retry", a1, address=address)
    assert retried.stdout.strip() == "retried 1 dead job", retried
    assert (await client.inspect(a1)).state == JobState.READY

    # A whole queue is purged only once confirmed: without a terminal, --yes says so.
    refused = await relay_trio("dead", "purge", "--queue", "alpha", "--all", address=address,
                               stdin="y\n")  # fmt: skip
    assert refused.code == 2 and "--yes" in refused.stderr, refused
    assert (await client.inspect(a2)).state == JobState.DEAD
    confirmed = await on_a_terminal("y", "dead", "purge", "--queue", "beta", "--all",
                                    address=address)  # fmt: skip
    assert confirmed.stdout.strip() == "purged 1 dead job", confirmed
    forced = await relay_trio("dead", "purge", "--queue", "alpha", "--all", "--yes", "--json",
                              address=address)  # fmt: skip
    assert forced.json() == {"count": 1}
    empty = await relay_trio("dead", "list", address=address)
    assert "no dead jobs" in empty.stdout


async def shown_ids(address: str) -> dict[str, str]:
    """What ``dead list`` (not --full) prints for each dead job: its whole id -> the id as
    the table shows it."""
    listed = await relay_trio("dead", "list", "--json", address=address)
    whole = [job["job_id"] for job in listed.json()["jobs"]]
    table = await relay_trio("dead", "list", address=address)
    shown = [line.split()[0] for line in table.stdout.splitlines() if line.startswith("job_")]
    assert len(shown) == len(whole), table.stdout
    return dict(zip(whole, shown, strict=True))


async def test_an_id_as_dead_list_shows_it_can_be_typed_back(address, client):
    """``inspect``, ``dead retry`` and ``dead purge`` take an id as ``dead list`` prints it,
    abbreviated: the one job whose id begins so. One that several jobs' ids begin with,
    or none, or that is not an id's start at all, is one line."""
    lone = await make_dead(client, "alpha", "card declined")
    shown = (await shown_ids(address))[lone]
    assert shown == lone[:11]  # the only dead job: 7 hex digits
    panel = await relay_trio("inspect", shown, address=address)
    assert panel.code == 0 and lone in panel.stdout and "card declined" in panel.stdout, panel
    as_json = (await relay_trio("inspect", shown, "--json", address=address)).json()
    assert as_json["job_id"] == lone and as_json["state"] == "dead"
    retried = await relay_trio("dead", "retry", shown, address=address)
    assert retried.stdout.strip() == f"retried 1 dead job: {lone}", retried
    assert (await client.inspect(lone)).state == JobState.READY

    # Two jobs of one batch, made in one millisecond: their ids differ only at their end.
    await client.submit_batch([relay.job_fields("beta", n, retries=0) for n in range(2)])
    for job in await client.lease(["beta"], WORKER, count=2):
        await client.fail(job.job_id, WORKER, job.token, "410 Gone", retryable=False)
    shown_of = await shown_ids(address)
    a, b = sorted(shown_of)
    common = common_start(a, b)
    assert len(common) >= len("job_") + 10  # the millisecond's digits at least
    assert (shown_of[a], shown_of[b]) == (a[: len(common) + 1], b[: len(common) + 1])
    results = {}

    async def run(name: str, *args: str) -> None:
        results[name] = await relay_trio(*args, address=address)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "ambiguous", "inspect", common)
        nursery.start_soon(run, "ambiguous retry", "dead", "retry", a[:11])
        nursery.start_soon(run, "unknown", "inspect", "job_0000000")
        nursery.start_soon(run, "unknown purge", "dead", "purge", "job_0000000")
        nursery.start_soon(run, "too short", "inspect", a[:10])
        nursery.start_soon(run, "not an id", "dead", "retry", "34472d0")
        nursery.start_soon(run, "a", "inspect", shown_of[a], "--json")
    for name in ("ambiguous", "ambiguous retry"):
        assert_one_line_error(results[name], "job_id", "more than one job", code=2)
    for name in ("unknown", "unknown purge"):
        assert_one_line_error(results[name], "not_found", "job_0000000")
    assert_one_line_error(results["too short"], a[:10], "not a job id", code=2)
    assert_one_line_error(results["not an id"], "34472d0", "not a job id", code=2)
    assert results["a"].json()["job_id"] == a

    # The first job dead again, beside the batch's (made seconds later): it is shown by
    # the digits that tell it from theirs, and purged by them.
    (job,) = await client.lease(["alpha"], WORKER)
    await client.fail(job.job_id, WORKER, job.token, "card declined again", retryable=False)
    shown = (await shown_ids(address))[lone]
    assert len("job_") + 7 <= len(shown) < len(lone) and lone.startswith(shown)
    purged = await relay_trio("dead", "purge", shown, address=address)
    assert purged.stdout.strip() == f"purged 1 dead job: {lone}", purged
    assert sorted(job.job_id for job in (await client.dead_list()).jobs) == [a, b]


async def test_an_id_as_dead_list_shows_it_among_many_jobs_is_typed_back(address, client):
    """The shown id is unique among all jobs, not only among the rows shown: one dead job
    among 20 made at once (one millisecond: their ids differ in their last digits) is
    shown with every digit that tells it from the others, and typed back as shown. (Shown
    as the shortest start unique among the rows, "job_" and 7 digits, it matched all 20.)
    Then one of 20 submitted one by one, made dead and typed back the same way."""
    batch = await client.submit_batch([relay.job_fields("a", n, retries=0) for n in range(20)])
    (job,) = await client.lease(["a"], WORKER)
    await client.fail(job.job_id, WORKER, job.token, "card declined", retryable=False)
    shown = (await shown_ids(address))[job.job_id]
    as_json = await relay_trio("inspect", shown, "--json", address=address)
    assert as_json.code == 0 and as_json.json()["job_id"] == job.job_id, as_json
    retried = await relay_trio("dead", "retry", shown, address=address)
    assert retried.code == 0 and "retried 1 dead job" in retried.stdout, retried
    assert (await client.inspect(job.job_id)).state == JobState.READY
    assert job.job_id in {result.job_id for result in batch}
    assert job.job_id.startswith(shown) and len(shown) > len("job_") + 7
    assert shown == (await client.short_ids([job.job_id]))[0]

    ones = [(await client.submit("b", n, retries=0)).job_id for n in range(20)]
    (job,) = await client.lease(["b"], WORKER)
    await client.fail(job.job_id, WORKER, job.token, "410 Gone", retryable=False)
    shown = (await shown_ids(address))[job.job_id]
    assert job.job_id.startswith(shown) and job.job_id == ones[0]
    panel = await relay_trio("inspect", shown, address=address)
    assert panel.code == 0 and job.job_id in panel.stdout and "410 Gone" in panel.stdout, panel
    purged = await relay_trio("dead", "purge", shown, address=address)
    assert purged.code == 0 and "purged 1 dead job" in purged.stdout, purged


async def answer_as_an_older_server(page: dict, stream: trio.SocketStream) -> None:
    """A relay-trio server from before ``short_ids``: it answers hello and dead_list (with
    ``page``), and any other op unknown_op."""
    data = b""
    async with stream:
        while more := await stream.receive_some(65536):
            data += more
            *lines, data = data.split(b"\n")
            for line in lines:
                request = orjson.loads(line)
                reply: dict = {"id": request["id"], "ok": True}
                if request["op"] == "hello":
                    reply |= {"server": "relay-trio", "version": "0.0.1", "protocol": 1,
                              "limits": {}, "role": "admin"}  # fmt: skip
                elif request["op"] == "dead_list":
                    reply |= page
                else:
                    unknown = {"code": "unknown_op", "message": f"unknown op {request['op']!r}"}
                    reply |= {"ok": False, "error": unknown}
                await stream.send_all(orjson.dumps(reply) + b"\n")


async def test_dead_list_from_a_server_without_short_ids_shortens_among_the_rows(nursery):
    a, b, lone = "job_3447348000000000", "job_3447348000000001", "job_2000000000000000"
    job = {"queue": "q", "state": "dead", "priority": "normal", "payload": 1, "attempt": 1,
           "max_attempts": 1, "created_at": 0, "errors": [], "last_error": "boom"}  # fmt: skip
    page = {"jobs": [{**job, "job_id": i} for i in (a, b, lone)], "next_cursor": None}
    handler = functools.partial(answer_as_an_older_server, page)
    (listener,) = await nursery.start(functools.partial(trio.serve_tcp, handler, 0,
                                                        host="127.0.0.1"))  # fmt: skip
    older = f"127.0.0.1:{listener.socket.getsockname()[1]}"
    listed = await relay_trio("dead", "list", address=older)
    assert listed.code == 0 and listed.stderr == "", listed
    rows = [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("job_")]
    assert rows == [a, b, lone[:11]]


JOB_ID = re.compile(r"job_[0-9a-f]{16}")
NEXT_PAGE = re.compile(r"--cursor (job_[0-9a-f]{16})")


async def test_dead_list_shows_the_newest_first_and_pages_in_either_order(address, client):
    ids = [await make_dead(client, "q", f"error {n}") for n in range(3)]
    runs = {
        "table": ("dead", "list", "--full"),
        "json": ("dead", "list", "--json"),
        "oldest table": ("dead", "list", "--oldest", "--full"),
        "oldest json": ("dead", "list", "--oldest", "--json"),
    }
    results = {}

    async def run(name: str, *args: str) -> None:
        results[name] = await relay_trio(*args, address=address)

    async def pages(name: str, *args: str) -> None:
        """Every page of one job, following the cursor the table's caption prints."""
        seen: list[str] = []
        more: tuple[str, ...] = ()
        for _ in range(5):
            page = await relay_trio(
                "dead", "list", "--full", "--limit", "1", *args, *more, address=address
            )
            assert page.code == 0, page
            [row] = [line for line in page.stdout.splitlines() if line.startswith("job_")]
            seen += JOB_ID.findall(row)
            if (cursor := NEXT_PAGE.search(page.stdout)) is None:
                break
            assert cursor[1] == seen[-1], page.stdout
            more = ("--cursor", cursor[1])
        results[name] = seen

    async with trio.open_nursery() as nursery:
        for name, args in runs.items():
            nursery.start_soon(run, name, *args)
        nursery.start_soon(pages, "newest pages")
        nursery.start_soon(pages, "oldest pages", "--oldest")
    for name in runs:
        assert results[name].code == 0, results[name]
    newest = ids[::-1]
    assert JOB_ID.findall(results["table"].stdout) == newest
    assert "newest first" in results["table"].stdout
    assert [job["job_id"] for job in results["json"].json()["jobs"]] == newest
    assert JOB_ID.findall(results["oldest table"].stdout) == ids
    assert "oldest first" in results["oldest table"].stdout
    assert [job["job_id"] for job in results["oldest json"].json()["jobs"]] == ids
    assert results["newest pages"] == newest
    assert results["oldest pages"] == ids


async def test_dead_retry_and_purge_need_a_job_or_a_whole_queue(address):
    async with trio.open_nursery() as nursery:
        results = {}

        async def run(name: str, *args: str) -> None:
            results[name] = await relay_trio(*args, address=address)

        nursery.start_soon(run, "nothing", "dead", "retry")
        nursery.start_soon(run, "queue without all", "dead", "purge", "--queue", "q")
        nursery.start_soon(
            run, "both", "dead", "retry", "job_0000000000000001", "--queue", "q", "--all"
        )
    assert_one_line_error(results["nothing"], "give a JOB id", code=2)
    assert_one_line_error(results["queue without all"], "--all", code=2)
    assert_one_line_error(results["both"], "not both", code=2)


# -- errors -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def answer_http(stream: trio.SocketStream) -> None:
    """A server of another kind: it answers a relay-trio request with an HTTP error."""
    await stream.receive_some(65536)
    await stream.send_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    await stream.aclose()


async def test_errors_are_one_line_with_a_non_zero_exit(address, nursery):
    closed = f"127.0.0.1:{free_port()}"
    (http,) = await nursery.start(
        functools.partial(trio.serve_tcp, answer_http, 0, host="127.0.0.1")
    )
    other = f"127.0.0.1:{http.socket.getsockname()[1]}"
    cases = {
        "not a relay-trio server": (["stats"], other),
        "unreachable": (["stats", "--address", closed], None),
        "unreachable json": (["dead", "list", "--json"], closed),
        "bad json": (["submit", "q", "--payload", "{oops"], address),
        "bad json on stdin": (["submit", "q", "--payload", "-"], address),
        "unknown job": (["inspect", "job_0000000000000001"], address),
        "bad priority": (["submit", "q", "--payload", "1", "--priority", "urgent"], address),
        "bad backoff": (["submit", "q", "--payload", "1", "--backoff", "linear:5"], address),
        "bad address": (["stats", "--address", "nowhere"], None),
        "server refuses": (["submit", "bad queue!", "--payload", "1"], address),
        "worker refuses": (["worker", "--queue", "bad queue!"], address),
        "no command": (["frobnicate"], None),
        "demo db nowhere": (["demo", "--db", "/no/such/dir/demo.db"], None),
    }
    results = {}

    async def run(name: str) -> None:
        args, where = cases[name]
        stdin = "{not json" if name == "bad json on stdin" else None
        results[name] = await relay_trio(*args, address=where, stdin=stdin)

    async with trio.open_nursery() as nursery:
        for name in cases:
            nursery.start_soon(run, name)

    assert_one_line_error(results["unreachable"], f"cannot connect to {closed}", "refused")
    assert_one_line_error(results["unreachable json"], f"cannot connect to {closed}")
    assert_one_line_error(results["not a relay-trio server"], other, "not answer as a relay-trio")
    assert_one_line_error(results["bad json"], "--payload", "not valid JSON", code=2)
    assert_one_line_error(results["bad json on stdin"], "--payload", "not valid JSON", code=2)
    assert_one_line_error(results["unknown job"], "not_found", "job_0000000000000001")
    assert_one_line_error(results["bad priority"], "--priority", "urgent", code=2)
    assert_one_line_error(results["bad backoff"], "--backoff", "fixed:DELAY", code=2)
    assert_one_line_error(results["bad address"], "--address", "HOST:PORT", code=2)
    # The same mistake, the same exit code: a usage error, whoever finds it.
    assert_one_line_error(results["server refuses"], "bad_request", "queue", code=2)
    assert_one_line_error(results["worker refuses"], "--queue", "bad queue!", code=2)
    assert_one_line_error(results["no command"], "frobnicate", code=2)
    assert_one_line_error(results["demo db nowhere"], "--db", "no such directory", code=2)
    for result in results.values():
        assert result.stdout == ""


async def on_a_terminal(answer: str, *args: str, address: str) -> Result:
    """``relay-trio *args`` with a terminal (a pty) for stdin, where ``answer`` is typed."""
    leader, follower = os.openpty()
    try:
        os.write(leader, answer.encode() + b"\n")
        with trio.fail_after(COMMAND_TIMEOUT_S):
            done = await trio.run_process(
                [str(RELAY), *args], stdin=follower, capture_stdout=True, capture_stderr=True,
                check=False, env=cli_env(address),
            )  # fmt: skip
    finally:
        os.close(leader)
        os.close(follower)
    return Result(done.returncode, done.stdout.decode(), done.stderr.decode())


# -- demo ---------------------------------------------------------------------------------


def test_demo_runs_to_completion_and_prints_the_tables():
    result = relay_trio_sync("demo", timeout=60)
    assert result.code == 0, result
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert "Queues" in out and "Dead jobs" in out and "Done in" in out
    for queue in ("email", "thumbnails", "reports", "payments", "webhooks"):
        assert queue in out
    # 60 jobs: the 6 flaky ones succeed on their retry; 4 doomed and 4 rejected end dead.
    total = next(line for line in out.splitlines() if line.strip().startswith("total "))
    assert [w for w in total.split() if w.isdigit()] == ["0", "0", "0", "0", "52", "8", "60"]
    assert "DemoFailure" in out and "52/60" in out and "8/60" in out
    # The temporary database is gone.
    (db,) = re.findall(r"\((/\S+demo\.db)\)", out)
    assert not Path(db).exists() and not Path(db).parent.exists()


# -- worker -------------------------------------------------------------------------------


class WorkerProcess:
    """``relay-trio worker`` running; its stderr (JSON log lines) collected by ``pump``."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.stderr = b""
        self.started = trio.Event()

    async def pump(self) -> None:
        assert self.process.stderr is not None
        while data := await self.process.stderr.receive_some(65536):
            self.stderr += data
            if b'"worker.started"' in self.stderr:
                self.started.set()
        self.started.set()  # it exited: whoever waits finds out from the exit code

    def events(self) -> list[str]:
        return [orjson.loads(line)["event"] for line in self.stderr.splitlines() if line]


async def run_worker_until(address: str, args: list[str], body, env=None) -> WorkerProcess:
    """Start a worker, wait until it leases, run ``body()``, SIGTERM it; return it exited."""
    async with trio.open_nursery() as nursery:
        process = await trio.lowlevel.open_process(
            [str(RELAY), "worker", *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, env=env or cli_env(address),
        )  # fmt: skip
        worker = WorkerProcess(process)
        nursery.start_soon(worker.pump)
        try:
            with trio.fail_after(BOUND_S):
                await worker.started.wait()
            assert process.returncode is None, worker.stderr
            await body()
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(BOUND_S):
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True), trio.move_on_after(BOUND_S):
                    await process.wait()
    return worker


async def test_worker_runs_the_demo_executor_and_stops_on_sigterm(address, client):
    ids: dict[str, str] = {}

    async def body() -> None:
        ids["quick"] = (await client.submit("work", {"hello": 1})).job_id
        ids["slow"] = (await client.submit("other", {"sleep_ms": 200})).job_id
        ids["failing"] = (await client.submit("work", {"fail": True, "error": "nope"},
                                              retries=0)).job_id  # fmt: skip
        await wait_for_states(client, list(ids.values()), JobState.SUCCEEDED, JobState.DEAD)

    args = ["--queue", "work", "--queue", "other", "--concurrency", "4",
            "--shutdown-timeout-ms", "2000", "--lease-ms", "10000"]  # fmt: skip
    worker = await run_worker_until(address, args, body)
    assert worker.process.returncode == 0, worker.stderr
    assert "worker.draining" in worker.events() and "worker.stopped" in worker.events()
    # No --handler: said once, as the first job is taken, since it acks every job (found
    # from outside: a worker started without one emptied a real queue without a word).
    assert worker.events().count("worker.demo_handler") == 1, worker.events()
    # Every line is one JSON object (events() reads them all): the failed job's traceback
    # is a field of its one job.failed line, never lines of its own.
    assert not [line for line in worker.stderr.splitlines() if not line.startswith(b"{")]
    [failed] = [
        entry
        for entry in map(orjson.loads, worker.stderr.splitlines())
        if entry["event"] == "job.failed"
    ]
    assert (failed["level"], failed["job_id"], failed["state"]) == (
        "warning", ids["failing"], "dead",
    )  # fmt: skip
    assert failed["error"] == "DemoFailure: nope" and "dead" in failed["message"]
    assert ", in demo_handler\n" in failed["traceback"]
    assert failed["traceback"].endswith("DemoFailure: nope")

    assert (await client.inspect(ids["quick"])).state == JobState.SUCCEEDED
    slow = await client.inspect(ids["slow"])
    assert slow.state == JobState.SUCCEEDED and slow.result["slept_ms"] == 200
    failing = await client.inspect(ids["failing"])
    assert failing.state == JobState.DEAD and failing.last_error == "DemoFailure: nope"


async def test_worker_runs_a_handler_imported_from_the_path(address, client, tmp_path):
    (tmp_path / "myjobs.py").write_text(
        textwrap.dedent("""
        def double(job):
            return {"doubled": job.payload["n"] * 2, "queue": job.queue}
    """)
    )
    job_ids: list[str] = []

    async def body() -> None:
        for n in (1, 21):
            job_ids.append((await client.submit("math", {"n": n})).job_id)
        await wait_for_states(client, job_ids, JobState.SUCCEEDED, JobState.DEAD)

    env = cli_env(address, PYTHONPATH=str(tmp_path))
    worker = await run_worker_until(address, ["--queue", "math", "--handler", "myjobs:double"],
                                    body, env=env)  # fmt: skip
    assert worker.process.returncode == 0, worker.stderr
    assert "worker.demo_handler" not in worker.events()
    results = [(await client.inspect(job_id)).result for job_id in job_ids]
    assert results == [{"doubled": 2, "queue": "math"}, {"doubled": 42, "queue": "math"}]


async def test_worker_refuses_what_it_cannot_run(address):
    cases = {
        "no module": ["--queue", "q", "--handler", "no_such_module_here:run"],
        "no function": ["--queue", "q", "--handler", "json:no_such_function"],
        "not module:function": ["--queue", "q", "--handler", "json"],
        "lease too long": ["--queue", "q", "--lease-ms", str(10**12)],
        "bad queue": ["--queue", "no spaces"],
    }
    results = {}

    async def run(name: str) -> None:
        results[name] = await relay_trio("worker", *cases[name], address=address)

    async with trio.open_nursery() as nursery:
        for name in cases:
            nursery.start_soon(run, name)
    assert_one_line_error(results["no module"], "--handler", "no_such_module_here", code=2)
    assert_one_line_error(results["no function"], "no_such_function", code=2)
    assert_one_line_error(results["not module:function"], "module:function", code=2)
    assert_one_line_error(results["lease too long"], "--lease-ms", "max_lease_ms", code=2)
    assert_one_line_error(results["bad queue"], "--queue", code=2)
