"""``relay-trio top``: its view, drawn into a recording Console, shows what the server says,
a line per queue and per failure at 80 columns as at 200."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from rich.console import Console

import relay
from relay.client.client import Client, ServerInfo, WorkersPage
from relay.client.replies import structure_reply
from relay.protocol.errors import UnknownOp
from relay_cli import views
from relay_cli.top import RATE_WINDOW_S, SPARK_STEPS, TopView, _follow, age, follow
from relay_cli.views import SPARKS, sparkline
from tests.conftest import T0
from tests.server.conftest import BOUND_S, start_server

from .test_views import QUEUE_40, job_id, lines_of, row

W = "top-worker"


# The states top shows while no job is cancelled (the cancelled column comes with one).
BASE_STATES = [state for state in views.STATES if state not in views.SHOWN_IF_ANY]


def draw(view: TopView) -> str:
    console = Console(record=True, width=200, color_system=None)
    console.print(view.render())
    return console.export_text()


async def test_top_shows_the_counts_rates_and_failures_the_server_reports(server):
    now = [0.0]
    view = TopView(clock=lambda: now[0])
    host, port = server.handle.address
    async with relay.open_client(f"{host}:{port}") as client, trio.open_nursery() as nursery:
        nursery.start_soon(_follow, client, view)
        with trio.fail_after(BOUND_S):
            while view.server is None:  # noqa: ASYNC110 (its first stats)
                await trio.sleep(0.01)
        for n in range(5):
            await client.submit("mail", {"n": n}, retries=0)
        leased = await client.lease(["mail"], W, count=2)
        await client.ack(leased[0].job_id, W, leased[0].token)
        await client.fail(leased[1].job_id, W, leased[1].token, "smtp said no\ntrace")
        stats = await client.stats()
        with trio.fail_after(BOUND_S):
            while view.queues.get("mail") != stats.queues["mail"] or not view.failures:  # noqa: ASYNC110
                await trio.sleep(0.01)
        # The failure's id as the server abbreviates it, unique among all its jobs: its
        # neighbours were made within milliseconds, so 8 digits at least.
        (short,) = await client.short_ids([leased[1].job_id])
        assert len(short) > len("job_") + 7
        assert (await client.inspect(short, prefix=True)).job_id == leased[1].job_id
        nursery.cancel_scope.cancel()
    text = draw(view)
    cells = mail_row(text)
    counts = dict(zip(["pending", "ready", "leased", "retrying", "succeeded", "dead"],
                      cells[1:7], strict=True))  # fmt: skip
    # (no job is cancelled: its column is left out)
    assert stats.queues["mail"]["cancelled"] == 0
    assert counts == {s: str(n) for s, n in stats.queues["mail"].items() if s != "cancelled"}
    assert counts["ready"] == "3" and counts["succeeded"] == "1" and counts["dead"] == "1"
    assert cells[7] == age(view.oldest_ready_ms["mail"])  # the 3 ready jobs' wait
    # 5 submitted, 1 succeeded, 1 failed in top's first second (the clock stands still):
    # per second over that second, not over the 10 s window it has not watched.
    assert cells[8:11] == ["5.0", "1.0", "1.0"]
    failure = next(line for line in text.splitlines() if "smtp said no" in line)
    assert failure.startswith(short + " ") and "trace" not in text
    assert spark(text, "mail ") == ""  # no step of 10 s has ended since top started
    now[0] += 11  # the window moves on: the rates fall to zero, the counts stay
    assert mail_row(draw(view))[8:11] == ["0.0", "0.0", "0.0"]
    # and the step that ended shows its 1 job succeeded, at the sparkline's full height
    assert spark(draw(view), "mail ") == "█"


def spark(text: str, start: str) -> str:
    """The sparkline at the end of the row that starts with ``start``."""
    line = next(line for line in text.splitlines() if line.startswith(start))
    return line.split()[-1] if set(line.split()[-1]) <= set(SPARKS + "·") else ""


def mail_row(text: str) -> list[str]:
    """The cells of the queue "mail"'s row: its name, six counts, the wait, three rates."""
    words = next(line for line in text.splitlines() if line.startswith("mail ")).split()
    if spark(text, "mail "):
        words = words[:-1]
    return [*words[:7], " ".join(words[7:-3]), *words[-3:]]


def test_top_says_when_it_reconnects_and_what_it_lost():
    view = TopView(clock=lambda: 0.0)
    view.status = "reconnecting to 127.0.0.1:7400 (ConnectionLost)"
    view.event({"event": "lagged", "dropped": 12})
    text = draw(view)
    assert "reconnecting to 127.0.0.1:7400" in text and "12 events lost to lag" in text


async def test_top_waiting_for_a_server_that_is_down_names_it_from_the_start(tmp_path):
    """While its first attempt waits (up to --timeout), top says where it connects (it said
    "connecting" alone: found from outside, 2026-12-04)."""
    with trio.socket.socket() as silent:
        await silent.bind(("127.0.0.1", 0))
        silent.listen(1)  # (never accepted: the hello waits for an answer)
        address = "{}:{}".format(*silent.getsockname())
        view = TopView()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow, address, None, None, view)
            await trio.testing.wait_all_tasks_blocked()
            assert view.status == f"connecting to {address}", view.status
            nursery.cancel_scope.cancel()


async def test_top_follows_the_server_across_a_restart(tmp_path):
    """The server goes away: top says it is reconnecting; the server comes back on the same
    address: top says connected again and shows the new counts."""
    db = str(tmp_path / "relay.db")
    view = TopView()

    async def until(done) -> None:
        with trio.fail_after(BOUND_S):
            while not done():  # noqa: ASYNC110 (the view is fed by its own task)
                await trio.sleep(0.01)

    async with trio.open_nursery() as outer:
        async with trio.open_nursery() as nursery:
            first = await start_server(nursery, db, shutdown_timeout_ms=1000)
            host, port = first.handle.address
            address = f"{host}:{port}"
            async with relay.open_client(address) as client:
                await client.submit("mail", {"n": 1})
            outer.start_soon(follow, address, None, None, view)
            await until(lambda: view.queues.get("mail", {}).get("ready") == 1)
            assert view.status == f"connected to {address}"
            first.handle.shutdown()
        await until(lambda: view.status.startswith("reconnecting"))
        assert "reconnecting" in draw(view)
        async with trio.open_nursery() as nursery:
            second = await start_server(nursery, db, port=port, shutdown_timeout_ms=1000)
            async with relay.open_client(address) as client:
                await client.submit("mail", {"n": 2})
            await until(lambda: view.queues.get("mail", {}).get("ready") == 2)
            assert view.status == f"connected to {address}"
            outer.cancel_scope.cancel()
            second.handle.shutdown()


def test_only_a_job_just_made_counts_as_submitted():
    view = TopView(clock=lambda: 0.0)
    view.counting_since = -10.0
    base = {"event": "job", "job_id": "job_1", "queue": "q", "attempt": 0, "at": 1}
    view.event({**base, "state": "ready"})  # submitted
    view.event({**base, "state": "pending", "job_id": "job_2"})  # submitted, delayed
    view.event({**base, "state": "ready", "from": "dead"})  # dead_retry: not a new job
    view.event({**base, "state": "ready", "from": "leased"})  # its first lease released
    view.event({**base, "state": "ready", "from": "pending", "job_id": "job_2"})  # due
    assert view.rates() == {"q": {"submitted": 2 / 10}}


def test_a_rate_in_the_first_seconds_is_over_the_time_watched():
    """Three jobs in top's first 3 s are 1 a second, not 0.3 (the window is 10 s); in its
    first second, over a second; from 10 s on, over the window; after a reconnect (the
    events in between lost), afresh."""
    now = [100.0]
    view = TopView(clock=lambda: now[0])
    base = {"event": "job", "queue": "q", "attempt": 0, "at": 1, "state": "ready"}
    now[0] = 100.2
    view.event({**base, "job_id": "job_1"})
    assert view.rates() == {"q": {"submitted": 1.0}}
    now[0] = 103.0
    view.event({**base, "job_id": "job_2"})
    view.event({**base, "job_id": "job_3"})
    assert view.rates() == {"q": {"submitted": 1.0}}
    now[0] = 110.1
    assert view.rates() == {"q": {"submitted": 3 / 10}}
    now[0] = 111.0
    view.watching()  # a reconnect
    view.event({**base, "job_id": "job_4"})
    assert view.rates() == {"q": {"submitted": 1.0}}


# -- the layout ---------------------------------------------------------------------------


def busy_view(full_ids: bool = False) -> TopView:
    """Three queues (one of 40 characters), counts in the millions, jobs going through at
    tens a second, and four failures, three of them from one batch."""
    now = [0.0]
    view = TopView(clock=lambda: now[0], full_ids=full_ids)
    queues = {
        "email": dict(ready=1_234_567, leased=16, retrying=2, succeeded=987_654_321, dead=3),
        "thumbnails.resize": dict(pending=5, ready=20, leased=8, succeeded=120_000),
        QUEUE_40: dict(pending=250_000, ready=7, leased=1, succeeded=99, dead=12),
    }
    view.stats({name: {state: counts.get(state, 0) for state in views.STATES}
                for name, counts in queues.items()}, ServerInfo("0.1.0", 1_000, 3),
               {"email": 3 * 3_600_000 + 5_000, QUEUE_40: 4_200})  # fmt: skip
    for _ in range(600):
        view.event({"event": "job", "job_id": "j", "queue": "thumbnails.resize", "attempt": 0,
                    "state": "ready", "at": 1})  # fmt: skip
        view.event({"event": "job", "job_id": "j", "queue": "thumbnails.resize", "attempt": 1,
                    "state": "succeeded", "from": "leased", "at": 1})  # fmt: skip
    view.event({"event": "job", "job_id": "j", "queue": QUEUE_40, "state": "dead",
                "from": "leased", "attempt": 3, "at": 1})  # fmt: skip
    for seq, error in enumerate(FAILURES):
        view.failure(job_id(T0, seq + 1), QUEUE_40 if seq == 1 else "email", seq + 1, error)
    view.failure(job_id(T0 + 3_000), "thumbnails.resize", 1, "PIL.UnidentifiedImageError: "
                 "cannot identify image file 'img-4-2.jpg'")  # fmt: skip
    view.status = "connected to 127.0.0.1:7400"
    view.counting_since = -RATE_WINDOW_S  # (watched for the whole window)
    return view


FAILURES = [
    "SMTPRecipientsRefused: 550 5.1.1 <ada@example.com> mailbox unavailable",
    "TimeoutError: warehouse query took over 30 s while computing the nightly reminders",
    "smtp.example.com closed the connection",
]


@pytest.mark.parametrize("width", [80, 120, 200])
def test_top_reads_as_a_line_per_queue_and_per_failure(width):
    view = busy_view()
    lines = lines_of(view.render(), width)
    split = lines.index(next(line for line in lines if "Latest failures" in line))
    lines, failures = lines[:split], lines[split:]
    assert lines[0] == "relay-trio top · connected to 127.0.0.1:7400 · 3 connections"
    # Every header whole, on one line (with "oldest" above "ready"); at 80 columns the
    # pending and succeeded counts make way for the queue names, at 120 for the sparkline
    # (4 minutes of it), at 200 all fit.
    headers = ["queue", *BASE_STATES, "ready", "sub/s", "ok/s", "fail/s"]
    if width < 200:
        headers = [header for header in headers if header not in ("pending", "succeeded")]
    if width >= 120:
        headers += ["ok/10s,", "4m" if width == 120 else "5m"]
    assert row(lines, "sub/s").split() == headers
    assert "oldest" in lines[2]
    cells = row(lines, "thumbnails.resize ").split()
    assert cells[-3:] == ["60.0", "60.0", "0.0"]  # 600 in the 10 s window
    email = row(lines, "email ").split()
    assert email[1:3] == (["1.23M", "16"] if width < 200 else ["0", "1.23M"])
    assert email[-5:-3] == ["3h", "00m"]
    assert ("987M" in email) == (width == 200)
    long = row(lines, "billing.i")
    if width == 80:
        name = long.split()[0]
        assert len(name) >= 20 and "…" in name and name.endswith("run-eu")
    else:
        assert long.startswith(QUEUE_40 + " ")
        assert ("250000" in long) == (width == 200)
    assert long.split()[-3:] == ["0.0", "0.0", "0.1"]

    assert failures[1].split() == ["job", "queue", "attempt", "error"]
    assert len(failures) == 3 + 4  # title, headers, rule, four failures
    shown = views.short_ids(failure[0] for failure in view.failures)
    # The batch's three ids differ only in their last digit: whole; the other, made 3 s
    # later, is told apart by its first 8 digits.
    assert sorted(len(short) - len("job_") for short in shown.values()) == [8, 16, 16, 16]
    for job, queue, attempt, error in view.failures:
        line = row(failures, shown[job] + " ")
        assert line.startswith(shown[job] + " ")
        assert f" {attempt}  " in line
        assert error[: 24 if width == 80 else 40] in line
        assert queue in line or (width == 80 and queue == QUEUE_40)


@pytest.mark.parametrize("width", [80, 200])
def test_top_shows_the_failures_ids_as_the_server_abbreviates_them(width):
    view = busy_view()
    ids = view.failure_ids()
    gone = job_id(T0 - 86_400_000)  # a failure no longer shown: not kept
    view.shorten({ids[0]: ids[0], ids[3]: ids[3][:13], gone: gone[:11]})
    assert view.short == {ids[0]: ids[0], ids[3]: ids[3][:13]}
    view.shorten({ids[3]: ids[3][:14]})  # asked again: jobs made since share more digits
    assert view.short == {ids[0]: ids[0], ids[3]: ids[3][:14]}
    lines = lines_of(view.render(), width)
    failures = lines[lines.index(next(line for line in lines if "Latest failures" in line)) :]
    shown = views.short_ids(ids, view.short)
    assert shown[ids[3]] == ids[3][:14]
    for job in ids:
        assert row(failures, shown[job] + " ").startswith(shown[job] + " ")


@pytest.mark.parametrize("width", [80, 120])
def test_top_shows_whole_ids_when_asked(width):
    view = busy_view(full_ids=True)
    lines = lines_of(view.render(), width)
    for job, _, _, error in view.failures:
        assert row(lines, job).startswith(job + "  ") and error[:18] in row(lines, job)


def test_top_before_its_first_stats_shows_empty_tables():
    view = TopView(clock=lambda: 0.0)
    lines = lines_of(view.render(), 80)
    assert lines[0] == "relay-trio top · connecting"
    assert "none yet" in row(lines, "none yet")
    view.stats({}, ServerInfo("0.1.0", 1_000, 1), {})
    assert lines_of(view.render(), 80)[0] == "relay-trio top · connecting · 1 connection"


def test_top_says_when_it_shows_the_first_page_of_queues():
    view = TopView(clock=lambda: 0.0)
    zeros = dict.fromkeys(views.STATES, 0)
    view.stats({"a": zeros, "b": zeros}, ServerInfo("0.1.0", 1_000, 1), {}, 12_000)
    assert lines_of(view.render(), 100)[0].endswith("· 1 connection · first 2 of 12000 queues")
    view.stats({"a": zeros}, ServerInfo("0.1.0", 1_000, 1), {})
    assert "first" not in lines_of(view.render(), 100)[0]


@pytest.mark.parametrize("width", [80, 200])
def test_top_marks_a_paused_queue(width):
    view = TopView(clock=lambda: 0.0)
    zeros = dict.fromkeys(views.STATES, 0)
    queues = {"mail": {**zeros, "ready": 7}, "sms": zeros, QUEUE_40: zeros}
    view.stats(queues, ServerInfo("0.1.0", 1_000, 1), {}, None, ["mail", QUEUE_40])
    lines = lines_of(view.render(), width)
    assert row(lines, "mail ").startswith("mail paused ")
    assert "7" in row(lines, "mail ").split()
    assert "paused" not in row(lines, "sms ")
    long_row = next(line for line in lines if line.startswith("billing"))
    if f"{QUEUE_40} paused" not in long_row:  # no room for the mark: named under the table
        assert "paused" not in long_row and f"paused (yellow): {QUEUE_40}" in map(str.strip, lines)
    view.stats(queues, ServerInfo("0.1.0", 1_000, 1), {})
    assert "paused" not in "\n".join(lines_of(view.render(), width))


@pytest.mark.parametrize("width", [80, 200])
def test_top_marks_a_queue_with_a_limit(width):
    view = TopView(clock=lambda: 0.0)
    zeros = dict.fromkeys(views.STATES, 0)
    queues = {"mail": {**zeros, "ready": 7}, "sms": zeros, QUEUE_40: zeros}
    view.stats(queues, ServerInfo("0.1.0", 1_000, 1), {}, None, ["mail"])
    view.limits(["mail", QUEUE_40])
    lines = lines_of(view.render(), width)
    assert row(lines, "mail ").startswith("mail paused limited ")
    assert "7" in row(lines, "mail ").split()
    assert "limited" not in row(lines, "sms ")
    long_row = next(line for line in lines if line.startswith("billing"))
    if f"{QUEUE_40} limited" not in long_row:  # no room for the mark: named under the table
        assert f"limited (cyan): {QUEUE_40}" in map(str.strip, lines)
    view.limits([])
    assert "limited" not in "\n".join(lines_of(view.render(), width))


async def test_top_learns_which_queues_have_a_limit_from_queue_list(server):
    view = TopView(clock=lambda: 0.0)
    host, port = server.handle.address
    async with relay.open_client(f"{host}:{port}") as client, trio.open_nursery() as nursery:
        await client.submit("capped", {})
        await client.submit("free", {})
        await client.queue_config("capped", rate={"limit": 5, "period_ms": 1000})
        nursery.start_soon(_follow, client, view)
        with trio.fail_after(BOUND_S):
            while "capped" not in view.limited:  # noqa: ASYNC110 (with its stats)
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    lines = lines_of(view.render(), 80)
    assert row(lines, "capped ").startswith("capped limited ")
    assert "limited" not in row(lines, "free ")


async def test_top_learns_which_queues_are_paused_from_stats(server):
    view = TopView(clock=lambda: 0.0)
    host, port = server.handle.address
    async with relay.open_client(f"{host}:{port}") as client, trio.open_nursery() as nursery:
        await client.submit("held", {})
        await client.queue_pause("held")
        nursery.start_soon(_follow, client, view)
        with trio.fail_after(BOUND_S):
            while "held" not in view.paused:  # noqa: ASYNC110 (its stats, a second apart)
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert row(lines_of(view.render(), 80), "held ").startswith("held paused ")


# -- the throughput's sparkline -----------------------------------------------------------


def test_a_sparkline_gives_each_value_a_height_by_its_share_of_the_largest():
    assert sparkline([None, 0, 1, 2, 4, 8]) == " ·▁▂▄█"
    assert sparkline([0, 0]) == "··" and sparkline([]) == ""
    assert sparkline([3, 3, 1_000_000]) == "▁▁█"  # a little is never drawn as nothing


def succeed(view: TopView, queue: str, n: int = 1) -> None:
    for _ in range(n):
        view.event({"event": "job", "job_id": "j", "queue": queue, "attempt": 1,
                    "state": "succeeded", "from": "leased", "at": 1})  # fmt: skip


@pytest.mark.parametrize("width", [80, 120, 200])
def test_top_draws_each_queues_last_minutes_where_they_fit(width):
    """Jobs succeeded per 10 s, a character a step: none at 80 columns (the counts keep
    their room), 4 minutes at 120 beside a 40-character name, 5 at 200."""
    now = [1_000.0]
    view = TopView(clock=lambda: now[0])
    zeros = dict.fromkeys(views.STATES, 0)
    view.stats({"mail": zeros, "sms": zeros, QUEUE_40: zeros}, ServerInfo("0.1.0", 1, 1), {})
    for n in [1, 2, 4, 8, 0, 4]:  # a step each, mail's jobs doubling
        succeed(view, "mail", n)
        succeed(view, QUEUE_40, 1)
        now[0] += 10
    lines = lines_of(view.render(), width)
    if width == 80:
        assert "ok/10s" not in "\n".join(lines)
        assert row(lines, "mail ").split()[-1] == "0.0"
        return
    steps = 24 if width == 120 else 30
    assert row(lines, "sub/s").split()[-1] == f"{steps // 6}m"
    # top started 6 steps ago: the steps before are blank, not zero
    assert row(lines, "mail ").endswith(" " * (steps - 6 + 1) + "▁▂▄█·▄")
    assert row(lines, "billing").endswith(" ██████")
    assert row(lines, "sms ").endswith(" ······")  # top saw none succeed
    now[0] += 300  # 5 minutes on: mail's steps scrolled out, and forgotten
    lines = lines_of(view.render(), width)
    assert row(lines, "mail ").endswith(" " + "·" * steps)
    assert view.done == {}


def test_top_keeps_a_few_numbers_per_queue_for_its_sparklines():
    now = [0.0]
    view = TopView(clock=lambda: now[0])
    for _ in range(3_000):  # 50 minutes of jobs, one a second
        succeed(view, "mail")
        now[0] += 1
    view.render()
    assert len(view.done["mail"]) <= SPARK_STEPS + 1
    assert view.throughput(["mail", "sms"]) == {"mail": [10] * SPARK_STEPS,
                                                "sms": [0] * SPARK_STEPS}  # fmt: skip


# -- the workers panel --------------------------------------------------------------------

AT = 1_700_000_000_000


def worker(worker_id: str, queues: list[str], held: int, longest: int | None, idle_ms: int,
           **more) -> dict:  # fmt: skip
    """A worker as workers_list gives it (docs/protocol.md, Workers)."""
    return {"worker_id": worker_id, "worker_ids": [worker_id], "client": more.get("client"),
            "peer": more.get("peer", "10.0.3.17:51234"), "queues": queues,
            "queues_total": more.get("queues_total", len(queues)), "jobs": [],
            "jobs_held": held, "longest_held_ms": longest, "connected_at": AT - 60_000,
            "first_lease_at": AT - 59_000, "last_request_at": AT - idle_ms,
            "parked": more.get("parked", 0)}  # fmt: skip


def workers_page(*workers: dict, total: int | None = None) -> WorkersPage:
    """A workers_list reply, read as the client reads it."""
    reply = {"server": "build-7:7400", "workers": list(workers), "at": AT, "next_cursor": None,
             "total": len(workers) if total is None else total}  # fmt: skip
    return structure_reply(reply, WorkersPage)


@pytest.mark.parametrize("width", [80, 120, 200])
def test_top_shows_the_connected_workers_and_the_queues_none_serves(width):
    view = busy_view()
    view.workers(workers_page(
        worker("thumbs-1f3a9c", ["thumbnails.resize"], 8, 4_200, 1_000, client="thumbnailer/2"),
        worker("mailer-0", ["email"], 17, None, 60_000, parked=1, peer="[fd00::17]:40000"),
    ))  # fmt: skip
    lines = lines_of(view.render(), width)
    assert "Workers of build-7:7400" in row(lines, "Workers of")
    headers = ["worker", "queues", "jobs", "held", "idle"]
    if width >= 120:
        headers[1:1] = ["client", "address"]
    assert row(lines, "idle").split() == headers
    mailer = row(lines, "mailer-0 ").split()
    # the most jobs held first; "?": held since a time the server does not know; "*": a
    # long-poll waiting
    assert lines.index(row(lines, "mailer-0 ")) < lines.index(row(lines, "thumbs-1f3a9c "))
    assert mailer[-5:] == ["17", "?", "1m", "00s", "*"]
    assert row(lines, "thumbs-1f3a9c ").split()[-5:] == ["8", "4.2", "s", "1.0", "s"]
    assert ("thumbnailer/2" in row(lines, "thumbs-1f3a9c ")) == (width >= 120)
    assert ("[fd00::17]:40000" in mailer) == (width >= 120)
    # The 40-character queue has ready jobs and no worker asks for it: stuck, not slow.
    said = " ".join(line.strip() for line in lines)  # (the line folds at 80 columns)
    assert f"ready jobs and no worker on this server: {QUEUE_40} Latest failures" in said


def test_top_shows_the_first_workers_and_says_how_many_more():
    view = busy_view()
    many = [worker(f"w-{n:02}", ["email"], n, 1_000, 0) for n in range(12)]
    view.workers(workers_page(*many, total=140))
    lines = lines_of(view.render(), 80)
    assert "w-11 " in row(lines, "w-11 ") and not any("w-03 " in line for line in lines)
    assert sum(line.startswith("w-") for line in lines) == 8
    assert any("8 of 140 workers" in line for line in lines)
    # not every worker known: no queue is said to have none
    assert not any("no worker" in line for line in lines)


def test_top_names_no_stuck_queue_where_a_workers_queues_were_cut():
    view = busy_view()
    view.workers(workers_page(worker("w", ["a"] * 32, 1, 1_000, 0, queues_total=40)))
    lines = lines_of(view.render(), 120)
    assert "+8" in row(lines, "w ")  # 8 more queues than listed
    assert not any("no worker" in line for line in lines)


def test_top_says_when_no_worker_is_connected():
    view = busy_view()
    view.workers(workers_page())
    lines = lines_of(view.render(), 80)
    assert row(lines, "no worker connected").strip() == "no worker connected"
    said = " ".join(line.strip() for line in lines)
    assert f"no worker on this server: {QUEUE_40}, email, thumbnails.resize Latest" in said


class OlderServer(Client):
    """A client of a server from before workers_list: it answers unknown_op."""

    async def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        if op == "workers_list":
            raise UnknownOp("unknown op: workers_list")
        return await super()._call(op, **fields)


async def test_top_shows_the_workers_the_server_lists(server):
    view = TopView(clock=lambda: 0.0)
    host, port = server.handle.address
    address = f"{host}:{port}"
    async with relay.open_client(address) as client, relay.open_client(address) as worker:
        for n in range(3):
            await client.submit("email", {"n": n})
        await client.submit("stuck", {})
        await worker.lease(["email", "sms"], "mailer-1", count=2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_follow, client, view)
            with trio.fail_after(BOUND_S):
                while view.connected is None or "stuck" not in view.queues:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    lines = lines_of(view.render(), 120)
    cells = row(lines, "mailer-1 ").split()  # (the client: "pytest on HOST, pid N", cut)
    at = cells.index("email,sms")
    assert cells[at + 1] == "2", cells
    assert "ready jobs and no worker on this server: stuck" in lines


async def test_top_hides_the_workers_panel_for_a_server_without_workers_list(server):
    """An extension: a server that answers workers_list with unknown_op gets no panel (a
    view that showed one, for the server before a restart, hides it), and top goes on."""
    view = TopView(clock=lambda: 0.0)
    view.workers(workers_page(worker("w", ["email"], 1, 1_000, 0)))
    assert "Workers" in "\n".join(lines_of(view.render(), 80))
    host, port = server.handle.address
    async with relay.open_client(f"{host}:{port}") as client, trio.open_nursery() as nursery:
        await client.submit("email", {})
        nursery.start_soon(_follow, OlderServer(client._transport), view)
        with trio.fail_after(BOUND_S):
            while view.connected is not None or "email" not in view.queues:  # noqa: ASYNC110
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    lines = lines_of(view.render(), 80)
    assert "Workers" not in "\n".join(lines) and row(lines, "email ")


def test_a_failures_text_is_shown_as_text_on_any_console():
    """A worker's error holding "[/]" once ended top in a MarkupError (its console read
    markup); it is shown as it is, its control characters as escapes."""
    view = TopView(clock=lambda: 0.0)
    view.failure(job_id(T0), "email", 1, "expected [/] got [bold]x\x1b[2J")
    text = draw(view)
    assert "expected [/] got [bold]x\\x1b[2J" in text and "\x1b[2J" not in text
