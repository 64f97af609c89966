"""The dashboard's views beyond the overview (relay/server/http/dashboard.html): the job
browser (#/jobs), one job (#/job/ID), the workers (#/workers), the overview's charts and
schedules, what each role may do, and the layout at 500 and 1920 px, in headless Chromium
with the fixtures and helpers of test_dashboard.py. Every wait is bounded; a view that is
slow to show a job's move fails its 2 s wait.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
import trio
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

import relay
from relay.server.requests.auth import Role, Tokens, _digest
from relay_scripts.browser import page_rates
from tests import pg
from tests.server.conftest import BOUND_S, RunningServer, start_server
from tests.server.http.test_dashboard import (
    ADMIN,
    MOVE_S,
    TOKENS,
    WORKER,
    W,
    click,
    dead_and_failed,
    no_console_errors,
    on_page,
    open_page,
    say_token,
    see,
    shows_stats,
    status_is,
    wait_until_gone,
)
from tests.server.http.test_dashboard import browser as browser  # the fixture
from tests.worker.helpers import running, serving, wait_for_state

# The jobs table as shown: [job id, state] per row, and the text beside the heading.
JOBS_JS = """
return [[...document.querySelectorAll("#jobs tbody tr[data-job]")].map(
          (r) => [r.dataset.job, r.querySelector('td[data-field="state"]').textContent]),
        document.getElementById("jobs-count").textContent];
"""


def jobs_shown(driver: Any) -> list[list[str]]:
    return driver.execute_script(JOBS_JS)[0]


async def shows_jobs(driver: Any, rows: list[list[str]], what: str) -> None:
    try:
        await see(driver, lambda d: jobs_shown(d) == rows, what, MOVE_S)
    except Exception:
        raise AssertionError(f"{what}: shown {await on_page(jobs_shown, driver)}") from None


def nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {state: n for state, n in counts.items() if n}


async def counts_become(client: relay.Client, queue: str, counts: dict[str, int]) -> None:
    """Wait (bounded) until ``stats`` says ``counts`` (those not zero) of ``queue``."""
    with trio.fail_after(BOUND_S):
        while nonzero((await client.stats()).queues.get(queue, {})) != counts:  # noqa: ASYNC110 (the server's)
            await trio.sleep(0.02)


async def dead_in(client: relay.Client, queue: str, error: str) -> str:
    """A dead job of ``queue`` (the only one it has ready), failed with ``error``."""
    submitted = (await client.submit(queue, {}, retries=0)).job_id
    (job,) = await client.lease([queue], W)
    assert job.job_id == submitted
    await client.fail(job.job_id, W, job.token, error, retryable=False)
    return submitted


async def server_jobs(client: relay.Client, **filters: Any) -> list[list[str]]:
    """The first page of jobs_list, newest first, as the page shows it."""
    page = await client.jobs_list(**filters)
    return [[job.job_id, str(job.state)] for job in page.jobs]


def go(route: str) -> Callable[[Any], bool]:
    """A condition that moves the open page to ``route`` (as a link would)."""

    def act(driver: Any) -> bool:
        driver.execute_script("location.hash = arguments[0]", route)
        return True

    return act


def confirm_text(selector: str) -> Callable[[Any], str]:
    """A condition that clicks ``selector``, accepts the confirm dialog, returns its text."""

    def act(driver: Any) -> str:
        driver.find_element(By.CSS_SELECTOR, selector).click()
        alert = driver.switch_to.alert
        text = alert.text
        alert.accept()
        return text

    return act


async def test_jobs_view_browses_each_state_newest_first_searches_and_follows_moves(
    server, browser
):
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        ids = [(await client.submit("email", {"n": n}, idempotency_key=f"order-{n}")).job_id
               for n in range(4)]  # fmt: skip
        later = (await client.submit("email", {"n": 9}, delay_ms=3_600_000)).job_id
        await client.submit("reports", {"n": 0})
        [job] = await client.lease(["email"], W)
        await client.ack(job.job_id, W, job.token, {"sent": True})
        await open_page(browser, server, "#/jobs?queue=email")
        await see(browser, status_is("connected"), "connected")
        expected = await server_jobs(client, queue="email")
        assert [row[0] for row in expected] == [later, *ids[::-1]]  # newest first
        await shows_jobs(browser, expected, "the jobs of email")
        count = await on_page(lambda: browser.execute_script(JOBS_JS)[1])
        assert count == "(5 of 5, newest first)"

        # A job moves: its row says so within 2 s.
        [leased] = await client.lease(["email"], W)
        await shows_jobs(browser, await server_jobs(client, queue="email"), "the lease shown")
        assert [leased.job_id, "leased"] in await on_page(jobs_shown, browser)

        # One state, chosen in the form: the route says it, the rows are the server's.
        await see(browser, lambda d: Select(d.find_element(By.NAME, "state")).select_by_value(
            "pending") or True, "the state")  # fmt: skip
        await shows_jobs(browser, [[later, "pending"]], "the pending job")
        assert await on_page(
            lambda: browser.current_url.endswith("#/jobs?queue=email&state=pending")
        )
        # Every queue, every state.
        await see(browser, go("#/jobs"), "every job")
        await shows_jobs(browser, await server_jobs(client), "every job")

        # Search: the start of an id; with a queue, of an idempotency key.
        await see(browser, go(f"#/jobs?search={ids[2][:12]}"), "an id's start")
        await shows_jobs(browser, await server_jobs(client, search=ids[2][:12]), "by id")
        await see(browser, go("#/jobs?queue=email&search=order-"), "a key's start")
        found = await server_jobs(client, queue="email", search="order-")
        assert len(found) == 4
        await shows_jobs(browser, found, "by key")
        await see(browser, go("#/jobs?search=order-"), "a key without its queue")
        note = await see(browser, lambda d: d.find_element(By.ID, "jobs-note").text, "a refusal")
        assert "search" in note
    assert await on_page(no_console_errors, browser) == []


async def test_bulk_actions_name_the_count_and_act_on_the_queue_and_state(server, browser):
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        dead = [await dead_and_failed(client, f"failed {n}") for n in range(3)]
        await client.submit("reports", {})
        await open_page(browser, server, "#/jobs?queue=email&state=dead")
        await see(browser, status_is("connected"), "connected")
        await shows_jobs(browser, [[j, "dead"] for j in dead[::-1]], "the dead jobs")
        assert await on_page(lambda: browser.find_element(By.ID, "dead-total").text) == "(3)"
        buttons = await on_page(browser.find_elements, By.CSS_SELECTOR, "#bulk button")
        assert [await on_page(lambda b=b: b.text) for b in buttons] == [
            "Retry all dead", "Purge all dead",
        ]  # fmt: skip

        text = await see(browser, confirm_text('#bulk button[data-bulk="retry"]'), "retry all")
        assert text == "Retry all 3 dead jobs of email?"
        await counts_become(client, "email", {"ready": 3})
        await shows_stats(browser, client)
        assert nonzero((await client.stats()).queues["email"]) == {"ready": 3}
        await shows_jobs(browser, [], "none dead left")

        await see(browser, go("#/jobs?queue=email&state=ready"), "the ready jobs")
        text = await see(browser, confirm_text('#bulk button[data-bulk="cancel"]'), "cancel all")
        assert text == "Cancel all 3 ready jobs of email?"
        await counts_become(client, "email", {"cancelled": 3})
        await shows_stats(browser, client)
        assert nonzero((await client.stats()).queues["email"]) == {"cancelled": 3}

        await see(browser, go("#/jobs?queue=email&state=cancelled"), "the cancelled jobs")
        text = await see(browser, confirm_text('#bulk button[data-bulk="purge"]'), "purge all")
        assert text.startswith("Purge all 3 cancelled jobs of email?")
        await counts_become(client, "email", {})
        await shows_stats(browser, client)
        queues = (await client.stats()).queues
        assert not nonzero(queues.get("email", {}))
        assert nonzero(queues["reports"]) == {"ready": 1}  # another queue: kept
    assert await on_page(no_console_errors, browser) == []


# The job view: its state, its buttons' actions, payload and result as shown, their notes,
# and per attempt [attempt, outcome, worker, ran, error].
JOB_JS = """
const text = (id) => document.getElementById(id).textContent;
return {
  state: text("job-state"),
  buttons: [...document.querySelectorAll("#job-actions button")].map((b) => b.dataset.action),
  payload: text("job-payload"), result: text("job-result"),
  notes: [text("payload-note"), text("result-note")],
  attempts: [...document.querySelectorAll("#attempts tbody tr[data-attempt]")].map((r) =>
    ["attempt", "outcome", "worker", "ran", "error"].map(
      (f) => { const td = r.querySelector(`td[data-field="${f}"]`);
               return (td.querySelector("summary") || td).textContent; })),
};
"""


async def job_view(driver: Any, want: Callable[[dict], bool], what: str) -> dict:
    return await see(driver, lambda d: (v := d.execute_script(JOB_JS)) and want(v) and v, what,
                     MOVE_S)  # fmt: skip


async def test_job_view_shows_payload_result_attempts_and_the_buttons_its_state_allows(
    server, browser
):
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        # A job that failed once, then succeeded with a result.
        job_id = (await client.submit("email", {"to": "ada@example.com"}, retries=1,
                                      backoff={"kind": "fixed", "delay_ms": 0})).job_id  # fmt: skip
        (first,) = await client.lease(["email"], "worker-a")
        await client.fail(job_id, "worker-a", first.token, "SMTPError: 421", traceback="Traceback")
        await wait_for_state(client, job_id, "ready")
        (second,) = await client.lease(["email"], "worker-b")
        await open_page(browser, server, f"#/job/{job_id}")
        await see(browser, status_is("connected"), "connected")
        view = await job_view(browser, lambda v: v["state"] == "leased", "the leased job")
        assert json.loads(view["payload"]) == {"to": "ada@example.com"}
        assert view["payload"] == json.dumps({"to": "ada@example.com"}, indent=2)
        assert view["attempts"][0][:3] == ["1", "failed", "worker-a"]
        assert view["attempts"][0][4] == "SMTPError: 421"
        assert view["attempts"][1][:3] == ["2", "running", "worker-b"]
        assert view["attempts"][1][3].endswith("so far") and view["buttons"] == ["cancel"]
        # It moves: shown within 2 s.
        await client.ack(job_id, "worker-b", second.token, {"id": 7, "sent": ["ada"]})
        view = await job_view(browser, lambda v: v["state"] == "succeeded", "the ack")
        assert json.loads(view["result"]) == {"id": 7, "sent": ["ada"]}
        assert view["attempts"][1][1] == "succeeded" and view["buttons"] == ["purge"]

        # A delayed job with a payload past 64 KiB: cut, said; Run now makes it ready.
        big = {"text": "x" * 70_000}
        later = (await client.submit("email", big, delay_ms=3_600_000)).job_id
        await see(browser, go(f"#/job/{later}"), "the delayed job")
        view = await job_view(browser, lambda v: v["state"] == "pending", "the delayed job")
        assert view["buttons"] == ["promote", "cancel"]
        assert len(view["payload"]) == 65536 and "first 65,536 of" in view["notes"][0]
        assert view["result"] == "none" and view["attempts"] == []
        await see(browser, click('#job-actions button[data-action="promote"]'), "Run now")
        await wait_for_state(client, later, "ready")
        view = await job_view(browser, lambda v: v["state"] == "ready", "promoted")
        assert view["buttons"] == ["cancel"]

        # A dead job: Retry and Purge.
        dead = await dead_in(client, "reports", "boom")
        await see(browser, go(f"#/job/{dead}"), "the dead job")
        view = await job_view(browser, lambda v: v["state"] == "dead", "the dead job")
        assert view["buttons"] == ["retry", "purge"]
        await see(browser, click('#job-actions button[data-action="retry"]'), "Retry")
        await job_view(browser, lambda v: v["state"] == "ready", "retried")
        # Unknown: said.
        await see(browser, go("#/job/job_0000000000000001"), "no such job")
        note = await see(browser, lambda d: d.find_element(By.ID, "job-note").text, "a note")
        assert "job_0000000000000001" in note
    assert await on_page(no_console_errors, browser) == []


# Per worker row: [worker id, queues, jobs held]; and the note of idle queues.
WORKERS_JS = """
return [[...document.querySelectorAll("#workers tbody tr[data-worker]")].map((r) =>
          [r.dataset.worker, r.querySelector('td[data-field="queues"]').textContent,
           r.querySelector('td[data-field="jobs"]').dataset.held]),
        document.getElementById("idle-queues").textContent];
"""
IDLE_JS = """
return [...document.querySelectorAll("#queues tbody tr[data-idle]")].map((r) => r.dataset.queue);
"""


async def test_workers_view_shows_what_each_worker_holds_and_queues_nobody_works(server, browser):
    address = "{}:{}".format(*server.handle.address)
    release = trio.Event()

    async def handler(job: relay.LeasedJob) -> None:
        await release.wait()

    async with relay.open_client(address) as client:
        await client.submit("orphans", {"n": 0})
        await open_page(browser, server, "#/workers")
        await see(browser, status_is("connected"), "connected")
        # (Of this server's workers: with several servers, another's may serve a queue.)
        await see(browser, lambda d: d.execute_script(WORKERS_JS) == [[], "Ready jobs and no "
                  "worker on this server: orphans (1)"], "no worker, and orphans idle",
                  MOVE_S)  # fmt: skip
        worker = relay.Worker(address, queues=["email"], handler=handler, worker_id="mailer-1")
        async with running(worker):
            held = (await client.submit("email", {"n": 1})).job_id
            await wait_for_state(client, held, "leased")
            shown = await see(browser, lambda d: (v := d.execute_script(WORKERS_JS))[0] and v,
                              "the worker", MOVE_S)  # fmt: skip
            assert shown[0] == [["mailer-1", "email", "1"]]
            page = await client.workers_list()
            assert [(w.worker_id, w.jobs_held) for w in page.workers] == [("mailer-1", 1)]
            assert await on_page(
                lambda: browser.find_element(By.CSS_SELECTOR, f'#workers a[href="#/job/{held}"]')
            )
            server_name = await on_page(lambda: browser.find_element(By.ID, "workers-count").text)
            assert page.server in server_name
            # The overview flags the queue no worker asks for, not the one that is busy.
            await see(browser, go("#/overview"), "the overview")
            await see(browser, lambda d: d.execute_script(IDLE_JS) == ["orphans"],
                      "orphans flagged", MOVE_S)  # fmt: skip
            release.set()
            await wait_for_state(client, held, "succeeded")
            await see(browser, go("#/workers"), "the workers")
            await see(browser, lambda d: d.execute_script(WORKERS_JS)[0] == [
                ["mailer-1", "email", "0"]], "nothing held", MOVE_S)  # fmt: skip
    assert await on_page(no_console_errors, browser) == []


# A chart's sums as drawn (data attributes) and how many bars (steps) it has.
CHART_JS = """
const f = document.getElementById(arguments[0]);
return [Number(f.dataset.points || 0), Number(f.dataset.submitted || -1),
        Number(f.dataset.succeeded || -1), Number(f.dataset.failed || -1),
        f.querySelectorAll("svg rect.succeeded").length];
"""


async def start_flushing(nursery: trio.Nursery, db: str) -> RunningServer:
    """A server that writes its history every 100 ms (not 5 s): the charts' tests."""
    return await start_server(nursery, db, history_flush_ms=100)


async def test_overview_charts_draw_the_servers_history(tmp_path, browser):
    async with (
        serving(start_flushing, str(tmp_path / "relay.db")) as server,
        relay.open_client("{}:{}".format(*server.handle.address)) as client,
    ):
        for n in range(3):
            await client.submit("email", {"n": n})
        await client.submit("reports", {})
        for job in await client.lease(["email"], W, count=3):
            await client.ack(job.job_id, W, job.token)
        await dead_and_failed(client, "boom")
        with trio.fail_after(BOUND_S):
            while sum(p.succeeded for p in (await client.history()).points) < 3:  # noqa: ASYNC110
                await trio.sleep(0.05)
        await open_page(browser, server)
        await see(browser, status_is("connected"), "connected")
        want = (await client.history()).points
        sums = [sum(p.submitted for p in want), 3, 1]
        assert sums == [5, 3, 1]
        hour = await see(browser, lambda d: (v := d.execute_script(CHART_JS, "chart-hour"))[1:4]
                         == sums and v, "the hour's chart", MOVE_S)  # fmt: skip
        assert hour[0] == 60 and hour[4] == 1  # a minute a bar; one minute had jobs succeed
        day = await see(browser, lambda d: (v := d.execute_script(CHART_JS, "chart-day"))[1:4]
                        == sums and v, "the day's chart", MOVE_S)  # fmt: skip
        assert day[0] == 48
        # One queue's: chosen, both charts are of it.
        await see(browser, lambda d: Select(d.find_element(By.ID, "chart-queue")).select_by_value(
            "reports") or True, "reports")  # fmt: skip
        for chart in ("chart-hour", "chart-day"):
            await see(browser, lambda d, c=chart: d.execute_script(CHART_JS, c)[1:4] == [1, 0, 0],
                      f"{chart} of reports", MOVE_S)  # fmt: skip
    assert await on_page(no_console_errors, browser) == []


SCHEDULE_BUTTONS_JS = """
const out = {};
for (const row of document.querySelectorAll("#schedules tbody tr[data-schedule]")) {
  const b = row.querySelector("button[data-action]");
  out[row.dataset.schedule] = b ? b.dataset.action : "";
}
return out;
"""


async def test_an_admin_pauses_and_resumes_a_schedule(server, browser):
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        await client.schedule_put("nightly", "30 2 * * *", "reports", {})
        await open_page(browser, server)
        await see(browser, status_is("connected"), "connected")
        await see(browser, lambda d: d.execute_script(SCHEDULE_BUTTONS_JS) == {"nightly": "pause"},
                  "Pause", MOVE_S)  # fmt: skip
        await see(browser, click('#schedules button[data-action="pause"]'), "pause")
        await see(browser, lambda d: d.execute_script(SCHEDULE_BUTTONS_JS) == {"nightly": "resume"},
                  "Resume", MOVE_S)  # fmt: skip
        assert [s.paused for s in (await client.schedule_list()).schedules] == [True]
        await see(browser, click('#schedules button[data-action="resume"]'), "resume")
        await see(browser, lambda d: d.execute_script(SCHEDULE_BUTTONS_JS) == {"nightly": "pause"},
                  "Pause again", MOVE_S)  # fmt: skip
        assert [s.paused for s in (await client.schedule_list()).schedules] == [False]
    assert await on_page(no_console_errors, browser) == []


# Every op an admin's button sends, called from the page's own script (as from its
# console): the server's answer to each, [code or "ok"].
ACTIONS_JS = """
const [job, done] = [arguments[0], arguments[arguments.length - 1]];
const calls = [
  ["dead_retry", {job_id: job}], ["dead_purge", {job_id: job}], ["promote", {job_id: job}],
  ["dead_retry", {queue: "email", all: true, states: ["dead"]}],
  ["dead_purge", {queue: "email", all: true, states: ["dead"]}],
  ["cancel", {queue: "email", all: true, states: ["ready"]}],
  ["queue_pause", {queue: "email"}], ["schedule_pause", {name: "nightly"}],
  ["queue_config", {queue: "email", max_leased: 1}],
];
Promise.all(calls.map(([op, fields]) => request(op, fields).then(
  () => "ok", (e) => e.code))).then(done);
"""


async def test_a_worker_token_reads_every_view_and_the_server_refuses_its_actions(
    tmp_path, browser
):
    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=TOKENS)

    async with (
        serving(start, str(tmp_path / "relay.db")) as server,
        relay.open_client("{}:{}".format(*server.handle.address), token=ADMIN) as client,
    ):
        dead = await dead_and_failed(client, "boom")
        await client.submit("email", {})
        await client.schedule_put("nightly", "30 2 * * *", "reports", {})
        await open_page(browser, server, "#/jobs?queue=email&state=dead")
        await see(browser, status_is("token"), "the token form")
        await see(browser, say_token(WORKER), "the form")
        await see(browser, status_is("connected"), "connected as worker")
        await shows_jobs(browser, [[dead, "dead"]], "the dead job, read-only")
        assert await on_page(lambda: browser.find_element(By.ID, "role").text) == (
            "role: worker (read-only)"
        )
        for route, drawn in (
            ("#/overview", "#schedules tr[data-schedule]"),
            (f"#/job/{dead}", "#attempts tr[data-attempt]"),
            ("#/workers", "#workers td"),
            ("#/jobs?queue=email&state=dead", f'#jobs tr[data-job="{dead}"]'),
        ):
            await see(browser, go(route), route)
            # Drawn from the view's reply: a button would be there by now.
            await see(browser, lambda d, r=drawn: d.find_elements(By.CSS_SELECTOR, r), route,
                      MOVE_S)  # fmt: skip
            shown = await on_page(lambda: [
                b for b in browser.find_elements(By.CSS_SELECTOR, "button[data-action], "
                                                 "button[data-bulk], button[data-edit]")
                if b.is_displayed()
            ])  # fmt: skip
            assert shown == [], route
        await see(browser, go(f"#/job/{dead}"), "the job")
        await job_view(browser, lambda v: v["state"] == "dead", "the dead job, no button")
        answers = await on_page(browser.execute_async_script, ACTIONS_JS, dead)
        assert answers == ["unauthorized"] * 9
        assert (await client.inspect(dead)).state == "dead"
        assert (await client.stats()).paused == []
        # The same calls with an admin's token: done.
        await see(browser, click("#forget"), "forget")
        await see(browser, say_token(ADMIN), "the form")
        await see(browser, status_is("connected"), "connected as admin")
        answers = await on_page(browser.execute_async_script, ACTIONS_JS, dead)
        assert answers[0] == "ok" and answers[6:] == ["ok"] * 3
    assert await on_page(no_console_errors, browser) == []


# Wider than the window: the page scrolls sideways.
OPEN_JS = "for (const d of document.querySelectorAll('main details')) d.open = true;"
# The cells of the view's stacked tables that do not say their column's name (a phone's
# width shows each row as a stack of cells, each named).
UNNAMED_JS = """
return [...document.querySelectorAll("main section:not([hidden]) table.stack tbody td")]
  .filter((td) => td.colSpan === 1 && !td.classList.contains("actions") && !td.dataset.label)
  .map((td) => td.parentElement.innerText.slice(0, 40));
"""
SCROLLS_JS = "return [document.documentElement.scrollWidth, window.innerWidth];"


@pytest.mark.parametrize("width", [500, 1920])
async def test_every_view_fits_the_width_without_scrolling_sideways(server, browser, width):
    address = "{}:{}".format(*server.handle.address)
    release = trio.Event()

    async def handler(job: relay.LeasedJob) -> None:
        await release.wait()

    await on_page(browser.set_window_size, width, 900)
    try:
        async with relay.open_client(address) as client:
            traceback = "Traceback (most recent call last):\n" + "  a long line " * 40
            dead = await dead_and_failed(client, "E" * 300, traceback)
            for queue in ("email", "thumbnails-for-the-very-long-named-gallery", "reports"):
                await client.submit(queue, {"text": "word " * 200}, idempotency_key="k" * 120)
            await client.schedule_put("nightly-report-for-every-region", "30 2 * * *",
                                      "reports", {})  # fmt: skip
            worker = relay.Worker(address, queues=["email"], handler=handler,
                                  worker_id="w" * 60)  # fmt: skip
            async with running(worker):
                await open_page(browser, server)
                await see(browser, status_is("connected"), "connected")
                for route, ready in (
                    ("#/overview", "#schedules tr[data-schedule]"),
                    ("#/jobs", "#jobs tr[data-job]"),
                    (f"#/job/{dead}", "#attempts tr[data-attempt]"),
                    ("#/workers", "#workers tr[data-worker]"),
                ):
                    await see(browser, go(route), route)
                    await see(browser, lambda d, r=ready: d.find_elements(By.CSS_SELECTOR, r),
                              f"{route} drawn", MOVE_S)  # fmt: skip
                    # (Its tracebacks open as well.)
                    await on_page(browser.execute_script, OPEN_JS)
                    scroll, inner = await on_page(browser.execute_script, SCROLLS_JS)
                    assert scroll <= inner, (route, scroll, inner)
                    assert await on_page(browser.execute_script, UNNAMED_JS) == [], route
                    if width == 1920 and route == "#/overview":
                        table = await on_page(
                            lambda: browser.find_element(By.ID, "queues").size["width"]
                        )
                        assert table > 1600  # the room is used
                release.set()
    finally:
        await on_page(browser.set_window_size, 1280, 800)
    assert await on_page(no_console_errors, browser) == []


# -- the actions of one job by id, their notes, what a row shows (review findings) -------------


@pytest.fixture(params=["sqlite", "postgres"])
async def either_server(request, tmp_path) -> AsyncIterator[RunningServer]:
    """A server on each store in turn."""
    db = str(tmp_path / "relay.db")
    if request.param == "postgres":
        db = pg.server_url(request.getfixturevalue("pg_url"), f"page_{secrets.token_hex(4)}")
    async with serving(start_server, db) as running_server:
        yield running_server


def note_of(note_id: str) -> Callable[[Any], str]:
    return lambda d: d.find_element(By.ID, note_id).text


async def test_job_view_retries_a_cancelled_job_and_purges_a_succeeded_one(either_server, browser):
    server = either_server
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        cancelled = (await client.submit("email", {"n": 1})).job_id
        await client.cancel(cancelled)
        await open_page(browser, server, f"#/job/{cancelled}")
        await see(browser, status_is("connected"), "connected")
        view = await job_view(browser, lambda v: v["state"] == "cancelled", "the cancelled job")
        assert view["buttons"] == ["retry", "purge"]
        await see(browser, click('#job-actions button[data-action="retry"]'), "Retry")
        await wait_for_state(client, cancelled, "ready")
        await job_view(browser, lambda v: v["state"] == "ready", "retried")
        assert await see(browser, note_of("job-note"), "the note") == f"Retried {cancelled}."

        done = (await client.submit("email", {"n": 2}, idempotency_key="K")).job_id
        leases = {j.job_id: j for j in await client.lease(["email"], W, count=2)}
        await client.ack(done, W, leases[done].token)
        await see(browser, go(f"#/job/{done}"), "the succeeded job")
        view = await job_view(browser, lambda v: v["state"] == "succeeded", "the succeeded job")
        assert view["buttons"] == ["purge"]
        text = await see(browser, confirm_text('#job-actions button[data-action="purge"]'), "Purge")
        assert text == f"Purge {done}? Its record is deleted for good."
        await wait_until_gone(client, done)
        # The result stays over the refreshes that find the job gone.
        purged = f"Purged {done}. Its record is deleted."
        assert await see(browser, note_of("job-note"), "the note") == purged
        await see(browser, lambda d: d.execute_script(JOB_JS)["state"] == "", "cleared", MOVE_S)
        assert await on_page(note_of("job-note"), browser) == purged
        # Its key outlives it: the producer's retry is the purged job, not a second run.
        again = await client.submit("email", {"n": 2}, idempotency_key="K")
        assert (again.job_id, again.duplicate) == (done, True)
    assert await on_page(no_console_errors, browser) == []


async def test_an_actions_result_stays_in_the_jobs_note_over_the_refreshes(server, browser):
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        for n in range(3):
            await client.submit("email", {"n": n})
        assert await client.cancel_queue("email") == 3
        await open_page(browser, server, "#/jobs?queue=email&state=cancelled")
        await see(browser, status_is("connected"), "connected")
        await see(browser, lambda d: len(jobs_shown(d)) == 3, "the cancelled jobs", MOVE_S)
        await see(browser, confirm_text('#bulk button[data-bulk="purge"]'), "purge all")
        await counts_become(client, "email", {})
        said = "Purged 3 cancelled jobs of email."
        assert await see(browser, lambda d: note_of("jobs-note")(d) == said and said, "the note")
        # Refreshed since (no job left shown), and the count the server answered still said.
        await shows_jobs(browser, [], "none left")
        await see(browser, go("#/jobs?queue=email"), "every state")
        assert await on_page(note_of("jobs-note"), browser) == ""  # (another view: cleared)

        # A row's action: its result stays too.
        dead = await dead_in(client, "email", "boom")
        await see(browser, go("#/jobs?queue=email&state=dead"), "the dead job")
        await see(browser, click(f'#jobs tr[data-job="{dead}"] button[data-action="retry"]'),
                  "Retry")  # fmt: skip
        await wait_for_state(client, dead, "ready")
        await shows_jobs(browser, [], "retried: not dead")
        assert await on_page(note_of("jobs-note"), browser) == f"Retried {dead}."
    assert await on_page(no_console_errors, browser) == []


ROWS_JS = """
const fields = ["priority", "worker", "when"];
return [[...document.querySelectorAll("#jobs thead th")].map((th) => th.textContent),
        Object.fromEntries([...document.querySelectorAll("#jobs tbody tr[data-job]")].map((r) =>
          [r.dataset.job,
           fields.map((f) => r.querySelector(`td[data-field="${f}"]`).textContent)])),
        document.getElementById("zone").textContent];
"""


async def test_a_job_row_shows_priority_worker_and_the_time_of_its_state(server, browser):
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        late = await client.submit("rows", {}, delay_ms=3_600_000, priority="low")
        held = (await client.submit("rows", {}, priority="high")).job_id
        (lease,) = await client.lease(["rows"], "worker-7")
        assert lease.job_id == held
        done = (await client.submit("rows", {})).job_id
        (second,) = await client.lease(["rows"], W)
        await client.ack(done, W, second.token)
        jobs = {job.job_id: job for job in (await client.jobs_list("rows")).jobs}
        await open_page(browser, server, "#/jobs?queue=rows")
        await see(browser, status_is("connected"), "connected")
        await see(browser, lambda d: len(jobs_shown(d)) == 3, "the jobs", MOVE_S)
        headers, rows, zone = await on_page(browser.execute_script, ROWS_JS)
        assert headers[3:7] == ["priority", "attempt", "worker", "runs at / finished"], headers
        # (The page's times in the browser's zone, said once: the test's browser runs in UTC.)
        assert zone == "times in UTC"
        when = jobs[late.job_id].run_at, jobs[done].finished_at
        assert rows[late.job_id] == ["low", "", time_text(when[0])]
        assert rows[held] == ["high", "worker-7", ""]
        assert rows[done] == ["normal", "", time_text(when[1])]
    assert await on_page(no_console_errors, browser) == []


def time_text(ms: int | None) -> str:
    """A time as the page shows it in UTC: 2026-12-03 13:05:09."""
    assert ms is not None
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


# The rectangles of the text of each element: one per line it takes.
LINES_JS = """
return arguments[0].map((sel) => { const range = document.createRange();
  range.selectNodeContents(document.querySelector(sel));
  return range.getClientRects().length; });
"""
PRODUCER = "producer-token-for-dashboard-tests"


async def test_at_500_px_the_token_form_breaks_no_word_and_a_producer_sees_no_rates(
    tmp_path, browser
):
    tokens = Tokens(((_digest(ADMIN), Role.ADMIN), (_digest(PRODUCER), Role.PRODUCER)))

    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=tokens)

    await on_page(browser.set_window_size, 500, 900)
    try:
        async with (
            serving(start, str(tmp_path / "relay.db")) as server,
            relay.open_client("{}:{}".format(*server.handle.address), token=ADMIN) as client,
        ):
            await client.submit("email", {})
            await open_page(browser, server)
            await see(browser, status_is("token"), "the token form")
            lines = await on_page(
                browser.execute_script, LINES_JS, ['label[for="token"]', "#token-submit"]
            )
            assert lines == [1, 1]  # "Token", "Connect": not "Tok|en", "Conn|ect"
            await see(browser, say_token(PRODUCER), "the form")
            await see(browser, status_is("connected"), "connected as producer")
            await shows_stats(browser, client)
            # A producer cannot watch: its rates are not known, not 0.0.
            rates = await on_page(page_rates, browser)
            assert rates == {"email": dict.fromkeys(["submitted", "succeeded", "failed"], "-")}
    finally:
        await on_page(browser.set_window_size, 1280, 800)


async def test_jobs_view_pages_on_past_a_short_or_empty_page_that_has_a_cursor(
    server, browser, monkeypatch
):
    """A page of every queue reads a bounded stretch of jobs (made 50 here, as many as the
    view shows): one may be short, or empty, and still say that older ones may follow.
    The view offers Older on each, and does not take an empty one for the end."""
    from relay.store import rows

    monkeypatch.setattr(rows, "MERGED_RUNS_MAX", 2, raising=False)  # (3 queues pending)
    monkeypatch.setattr(rows, "ROWS_EXAMINED_MAX", 50, raising=False)
    address = "{}:{}".format(*server.handle.address)
    queues = [f"q{i:02d}" for i in range(20)]

    async def batch(jobs: list[dict[str, Any]]) -> list[str]:
        return [r.job_id for r in await client.submit_batch(jobs)]

    async with relay.open_client(address) as client:
        # Oldest first: 3 pending, 100 ready, 2 pending, 40 ready.
        old = await batch([{"queue": q, "payload": {}, "delay_ms": 3_600_000} for q in queues[:3]])
        await batch([{"queue": q, "payload": {}} for q in queues for _ in range(5)])
        new = await batch([{"queue": q, "payload": {}, "delay_ms": 3_600_000} for q in queues[:2]])
        await batch([{"queue": q, "payload": {}} for q in queues for _ in range(2)])

        await open_page(browser, server, "#/jobs?state=pending")
        await see(browser, status_is("connected"), "connected")
        await shows_jobs(browser, [[j, "pending"] for j in new[::-1]], "the 2 newest pending")
        await see(browser, lambda d: "Fewer than a page" in d.find_element(By.ID, "jobs-note").text,
                  "the note on a short page")  # fmt: skip
        await see(browser, click("#jobs-older"), "older")
        # The next 50 jobs are all ready: an empty page, and Older still offered.
        await see(browser, lambda d: jobs_shown(d) == [] and "page 2" in
                  d.find_element(By.ID, "jobs-count").text, "an empty page 2")  # fmt: skip
        await see(browser, click("#jobs-older"), "older again")
        await shows_jobs(browser, [[j, "pending"] for j in old[::-1]], "the 3 oldest pending")
        assert "page 3" in await on_page(lambda: browser.execute_script(JOBS_JS)[1])
        assert await on_page(no_console_errors, browser) == []
