"""The dashboard page (GET / on the metrics listener, relay/server/http/dashboard.py and
dashboard.html): served to anyone with its headers and WebSocket URL, and, in a real
headless Chromium (scripts/browser.py), showing what the server says as jobs move.

The browser tests never skip: without Debian's chromium and chromium-driver they fail,
saying what to install (CI installs them in .ci/run). Every wait is bounded; a page that
is slow to show a job's move fails its 2 s wait.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import trio
from selenium.webdriver.common.by import By

import relay
from relay.protocol.errors import JobNotFound
from relay.server.http.dashboard import Dashboard
from relay.server.requests.auth import Role, Tokens, _digest
from relay_scripts.browser import (
    BrowserMissing,
    open_browser,
    page_counts,
    page_oldest,
    page_rates,
    wait_for,
)
from tests.server.conftest import BOUND_S, RunningServer, start_server
from tests.tls_helpers import tls_files as tls_files  # the fixture
from tests.worker.helpers import running, serving, wait_for_state
from tests.worker.helpers import start_server as start_stoppable

ADMIN = "admin-token-for-dashboard-tests"
WORKER = "worker-token-for-dashboard-tests"
WRONG = "wrong-token-for-dashboard-tests"
TOKENS = Tokens(((_digest(ADMIN), Role.ADMIN), (_digest(WORKER), Role.WORKER)))
W = "dashboard-test"
# The page must show a job's move within this (it asks for stats every second).
MOVE_S = 2.0


# -- over HTTP, without a browser -------------------------------------------------------------


async def http(
    address: tuple[str, int], method: str = "GET", path: str = "/", host: str | None = "localhost"
) -> tuple[int, dict[str, str], bytes]:
    """One request: (status, headers by lower-cased name, body)."""
    lines = [f"{method} {path} HTTP/1.1", "Connection: close"]
    if host is not None:
        lines.append(f"Host: {host}")
    with trio.fail_after(BOUND_S):
        stream = await trio.open_tcp_stream("127.0.0.1", address[1])
        async with stream:
            await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *fields = head.decode("latin-1").split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, _, v in (f.partition(":") for f in fields))
    return int(status.split()[1]), headers, body


def websocket_of(body: bytes) -> str:
    match = re.search(rb'data-websocket="([^"]*)"', body)
    assert match is not None, body[:500]
    return match.group(1).decode()


@pytest.fixture
async def exposed(tmp_path) -> AsyncIterator[RunningServer]:
    """Tokens, and the metrics listener on every interface: /metrics needs a token."""

    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=TOKENS, metrics_host="0.0.0.0")

    async with serving(start, str(tmp_path / "relay.db")) as server:
        yield server


async def test_page_needs_no_token_where_metrics_do(exposed):
    address = exposed.handle.metrics_address
    assert address is not None and exposed.handle.ws_address is not None
    status, headers, body = await http(address)
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["cache-control"] == "no-store"
    # The WebSocket listens on 127.0.0.1, not where the metrics do: that is its URL.
    url = f"ws://127.0.0.1:{exposed.handle.ws_address[1]}/"
    assert websocket_of(body) == url
    assert b'data-auth="token"' in body
    assert await http(address, "HEAD") == (200, headers, b"")
    # Everything else is as before: a token first.
    for method, path in (("GET", "/metrics"), ("GET", "/healthz"), ("POST", "/")):
        assert (await http(address, method, path))[0] == 401, (method, path)


async def test_page_policy_allows_its_own_script_and_style_and_its_websocket_only(server):
    address = server.handle.metrics_address
    _, headers, body = await http(address, host="127.0.0.1:7401")
    policy = dict(
        (d.split()[0], d.split()[1:]) for d in headers["content-security-policy"].split("; ")
    )
    text = body.decode()
    for tag in ("script", "style"):
        inline = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.S)
        assert len(inline) == 1
        digest = base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
        assert policy[f"{tag}-src"] == [f"'sha256-{digest}'"], tag
    assert (
        policy["connect-src"]
        == [websocket_of(body)]
        == [f"ws://127.0.0.1:{server.handle.ws_address[1]}/"]
    )
    assert policy["default-src"] == ["'none'"] and policy["frame-ancestors"] == ["'none'"]
    # Self-contained: nothing to load from anywhere (its links are its own hash routes),
    # and a size one can read.
    assert not re.search(rb'\bsrc=|\bhref="(?!#/)|url\(', body) and b"@import" not in body
    assert (
        body.count(b"\n") < 1550 and b'data-auth="none"' in body
    )  # (550 before settings, schedules; 780 before the jobs, job, workers views and charts;
    # 1450 before the held notes, the rows' priority, worker and time, the zone)


async def test_page_says_wss_when_the_server_has_tls(tmp_path, tls_files):
    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tls_cert=tls_files.cert, tls_key=tls_files.key)

    async with serving(start, str(tmp_path / "relay.db")) as server:
        # Both listeners on 127.0.0.1: the name the browser used, which the certificate has.
        _, headers, body = await http(server.handle.metrics_address, host="localhost:7401")
    assert websocket_of(body) == f"wss://localhost:{server.handle.ws_address[1]}/"
    assert f"connect-src {websocket_of(body)};" in headers["content-security-policy"]


async def test_page_without_a_websocket_endpoint_connects_nowhere(tmp_path):
    async with serving(
        lambda nursery, db: start_stoppable(nursery, db, metrics_port=0), str(tmp_path / "r.db")
    ) as server:
        assert server.handle.ws_address is None
        _, headers, body = await http(server.handle.metrics_address)
    assert websocket_of(body) == ""
    assert "connect-src 'none'" in headers["content-security-policy"]


@pytest.mark.parametrize(
    ("dashboard", "host_header", "local", "url"),
    [
        # Bound to one address that is not the metrics listener's: that address.
        (Dashboard("0.0.0.0", "127.0.0.1", 7402), b"queue.example:7401", "10.0.0.5",
         "ws://127.0.0.1:7402/"),
        (Dashboard("127.0.0.1", "::1", 7402), b"relay", "127.0.0.1", "ws://[::1]:7402/"),
        # On every interface, or beside the metrics listener: the host the browser used.
        (Dashboard("0.0.0.0", "0.0.0.0", 7402), b"queue.example:7401", "10.0.0.5",
         "ws://queue.example:7402/"),
        (Dashboard("::", "::", 9, tls=True), b"[fd00::5]:7401", "fd00::5", "wss://[fd00::5]:9/"),
        (Dashboard("10.0.0.5", "10.0.0.5", 7402, tls=True), b"queue.example", "10.0.0.5",
         "wss://queue.example:7402/"),
        # No Host header, or one that is not a host: where the request came in.
        (Dashboard("0.0.0.0", "0.0.0.0", 7402), None, "10.0.0.5", "ws://10.0.0.5:7402/"),
        (Dashboard("::", "::", 7402), b'x"><script>', "::1", "ws://[::1]:7402/"),
        (Dashboard("0.0.0.0", "0.0.0.0", 7402), b"a b", "10.0.0.5", "ws://10.0.0.5:7402/"),
        (Dashboard("127.0.0.1"), b"relay", "127.0.0.1", None),
    ],
)  # fmt: skip
def test_websocket_url_names_a_host_the_browser_reaches(dashboard, host_header, local, url):
    headers = [] if host_header is None else [(b"host", host_header)]
    body, _ = dashboard.response(headers, local)
    assert websocket_of(body) == (url or "")


# -- in a browser -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        driver = open_browser()
    except BrowserMissing as exc:
        pytest.fail(f"{exc}. The dashboard's browser tests do not skip.", pytrace=False)
    try:
        yield driver
    finally:
        driver.quit()


async def see(driver: Any, condition: Callable[[Any], Any], what: str, within: float = BOUND_S):
    """Wait (bounded) in a thread until ``condition(driver)`` holds; returns its value."""
    return await trio.to_thread.run_sync(wait_for, driver, condition, within, what)


async def on_page(fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(fn, *args)


def status_is(*states: str) -> Callable[[Any], bool]:
    def check(driver: Any) -> bool:
        return driver.find_element(By.ID, "status").get_attribute("data-status") in states

    return check


async def open_page(driver: Any, server: Any, route: str = "") -> None:
    """The page, at ``route`` (a hash route such as ``#/jobs?state=dead``; none: the
    overview)."""
    port = server.handle.metrics_address[1]
    await on_page(driver.get, f"http://127.0.0.1:{port}/{route}")


async def shows_stats(driver: Any, client: relay.Client, within: float = MOVE_S) -> None:
    """The page's counts become what ``stats`` says now, within ``within`` seconds."""
    queues = (await client.stats()).queues
    await see(driver, lambda d: page_counts(d) == queues, f"the counts {queues}", within)


def dead_row(job_id: str) -> str:
    return f'#jobs tr[data-job="{job_id}"]'


def click(selector: str, confirm: bool = False) -> Callable[[Any], bool]:
    """A condition that clicks the element (once it is there), and accepts the confirm
    dialog that follows if ``confirm``."""

    def act(driver: Any) -> bool:
        driver.find_element(By.CSS_SELECTOR, selector).click()
        if confirm:
            wait_for(driver, lambda d: d.switch_to.alert, BOUND_S, "the confirm dialog").accept()
        return True

    return act


def no_console_errors(driver: Any) -> list[Any]:
    """The page's errors in the browser's console. (The log also holds what the page of a
    test before said, trying to reconnect to its stopped server: another origin.)"""
    origin = "/".join(driver.current_url.split("/")[:3]) + "/"
    return [e for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and e["message"].startswith(origin)]  # fmt: skip


async def test_dashboard_shows_the_servers_numbers_and_follows_jobs(server, browser):
    address = "{}:{}".format(*server.handle.address)
    failed_once: set[str] = set()

    async def handler(job: relay.LeasedJob) -> None:
        if "fail" in job.payload and job.job_id not in failed_once:
            failed_once.add(job.job_id)
            raise RuntimeError(job.payload["fail"])

    async with relay.open_client(address) as client:
        for n in range(3):
            await client.submit("email", {"n": n})
        await client.submit("reports", {"n": 0})
        await open_page(browser, server, "#/jobs?state=dead")
        await see(browser, status_is("connected"), "connected")
        await shows_stats(browser, client, BOUND_S)
        assert set(await on_page(page_counts, browser)) == {"email", "reports"}
        # How long each queue's oldest ready job has waited, as relay-trio stats says it.
        oldest = await on_page(page_oldest, browser)
        assert set(oldest) == {"email", "reports"}, oldest
        assert all(re.fullmatch(r"\d+ ms|\d+\.\d s", text) for text in oldest.values()), oldest

        # One job moves: the page shows it within 2 s.
        [job] = await client.lease(["email"], W)
        await shows_stats(browser, client)
        await client.ack(job.job_id, W, job.token)
        await shows_stats(browser, client)

        # Jobs submitted while the page watches: the counts and the rate.
        for n in range(4):
            await client.submit("reports", {"n": n})
        await shows_stats(browser, client)
        await see(browser, lambda d: page_rates(d)["reports"]["submitted"] == "0.4", "0.4/s")

        # A worker runs them all; two fail for good, with their errors.
        smtp = (await client.submit("email", {"fail": "smtp said no"}, retries=0)).job_id
        disk = (await client.submit("email", {"fail": "disk full"}, retries=0)).job_id
        worker = relay.Worker(address, queues=["email", "reports"], handler=handler)
        async with running(worker):
            await wait_for_state(client, disk, "dead")
            await wait_for_state(client, smtp, "dead")
            await shows_stats(browser, client)
            for job_id, error in ((smtp, "smtp said no"), (disk, "disk full")):
                cell = await see(
                    browser,
                    lambda d, j=job_id: d.find_element(By.CSS_SELECTOR,
                                                       f'{dead_row(j)} td[data-field="error"]'),
                    f"the dead job {job_id}", MOVE_S,
                )  # fmt: skip
                assert await on_page(lambda c=cell: c.text) == f"RuntimeError: {error}"
            assert (await on_page(page_rates, browser))["email"]["failed"] != "0.0"

            # Retry runs it again (and it succeeds); purge deletes the other.
            await see(browser, click(f'{dead_row(smtp)} button[data-action="retry"]'), "retry")
            await wait_for_state(client, smtp, "succeeded")
            await see(browser, click(f'{dead_row(disk)} button[data-action="purge"]', True),
                      "purge")  # fmt: skip
            await wait_until_gone(client, disk)
            await shows_stats(browser, client)
            assert (await client.inspect(smtp)).attempt == 1  # a fresh attempt, run once
        await see(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, "#jobs tbody tr"),
                  "no dead job left", MOVE_S)  # fmt: skip
        # Every job has run: no queue has a ready job waiting.
        await see(browser, lambda d: set(page_oldest(d).values()) == {"-"}, "none ready", MOVE_S)
    assert await on_page(no_console_errors, browser) == []


# What the page shows of a traceback: its text, whether it scrolls (a bounded height), its
# font, and how many elements the text made (none: text, never HTML).
TRACEBACK_JS = """
const pre = document.querySelector(arguments[0]);
const style = getComputedStyle(pre);
return [pre.textContent, pre.scrollHeight > pre.clientHeight, style.overflowY,
        style.fontFamily, pre.children.length];
"""


async def dead_and_failed(client: relay.Client, error: str, traceback: str | None = None) -> str:
    """A dead job of queue "email", failed (not retryable) with ``error`` and ``traceback``."""
    submitted = await client.submit("email", {}, retries=0)
    (job,) = await client.lease(["email"], W)
    assert job.job_id == submitted.job_id
    await client.fail(job.job_id, W, job.token, error, retryable=False, traceback=traceback)
    return job.job_id


async def test_an_attempts_error_opens_onto_the_traceback_of_its_failure(server, browser):
    frames = "".join(
        f'  File "jobs.py", line {n}, in step_{n}\n    step_{n + 1}()\n' for n in range(60)
    )
    traceback = f"Traceback (most recent call last):\n{frames}ValueError: <b>not bold</b>"
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        failed = await dead_and_failed(client, "ValueError: <b>not bold</b>", traceback)
        plain = await dead_and_failed(client, "RuntimeError: no traceback sent")
        # The jobs list shows the last error's line; the job's view, each attempt's.
        await open_page(browser, server, "#/jobs?state=dead")
        await see(browser, status_is("connected"), "connected")
        cell = f'{dead_row(failed)} td[data-field="error"]'
        text = await see(
            browser, lambda d: d.find_element(By.CSS_SELECTOR, cell).text, "the dead job", MOVE_S
        )
        assert text == "ValueError: <b>not bold</b>"
        await see(browser, click(f'{dead_row(failed)} td[data-field="job"] a'), "the job's link")
        cell = '#attempts tr[data-attempt="1"] td[data-field="error"]'
        text = await see(
            browser, lambda d: d.find_element(By.CSS_SELECTOR, cell).text, "its attempt", MOVE_S
        )
        # Closed, the cell shows the error's line.
        assert text == "ValueError: <b>not bold</b>"
        shown = f"{cell} pre.traceback"
        assert not await on_page(
            lambda: browser.find_element(By.CSS_SELECTOR, shown).is_displayed()
        )

        # Opened: the whole traceback, as text, monospace, in a box that scrolls.
        await see(browser, click(f"{cell} summary"), "the error's toggle")
        await see(browser, lambda d: d.find_element(By.CSS_SELECTOR, shown).is_displayed(),
                  "the traceback", MOVE_S)  # fmt: skip
        text, scrolls, overflow, font, elements = await on_page(
            browser.execute_script, TRACEBACK_JS, shown
        )
        assert text == traceback and elements == 0
        assert scrolls and overflow == "auto" and "monospace" in font

        # It stays open while the job is drawn again (it is retried, and fails again).
        await client.dead_retry(failed)
        (job,) = await client.lease(["email"], W)
        await client.fail(failed, W, job.token, "RuntimeError: again", retryable=False)
        await see(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#attempts tbody tr")[1:],
                  "its second attempt", MOVE_S)  # fmt: skip
        assert await on_page(lambda: browser.find_element(By.CSS_SELECTOR, shown).is_displayed())

        # An attempt without a traceback: its error, no toggle.
        await on_page(browser.get, browser.current_url.replace(failed, plain))
        plain_cell = '#attempts tr[data-attempt="1"] td[data-field="error"]'
        await see(browser, lambda d: d.find_element(By.CSS_SELECTOR, plain_cell).text
                  == "RuntimeError: no traceback sent", "the plain error", MOVE_S)  # fmt: skip
        assert not await on_page(browser.find_elements, By.CSS_SELECTOR, f"{plain_cell} summary")
    assert await on_page(no_console_errors, browser) == []


async def wait_until_gone(client: relay.Client, job_id: str) -> None:
    with trio.fail_after(BOUND_S):
        while True:
            try:
                await client.inspect(job_id)
            except JobNotFound:
                return
            await trio.sleep(0.02)


# The dead jobs' rows as shown, and the text beside the heading ("(50 of 60, ...)").
DEAD_JS = """
return [[...document.querySelectorAll("#jobs tbody tr[data-job]")].map((r) => r.dataset.job),
        document.getElementById("jobs-count").textContent];
"""
# Whether the dead jobs' table and paging buttons fit the window's width (the queues'
# table, of 12 columns, does not at 500 px: it is not this test's).
FITS_JS = """
const table = document.getElementById("jobs").getBoundingClientRect();
const pages = document.getElementById("jobs-pages").getBoundingClientRect();
return table.right <= window.innerWidth && pages.width > 0 && pages.right <= window.innerWidth;
"""


def dead_shown(driver: Any) -> tuple[list[str], str]:
    rows, count = driver.execute_script(DEAD_JS)
    return rows, count


async def shows_dead(driver: Any, rows: list[str], count: str) -> None:
    """The dead table shows exactly ``rows``, in order, and the count text has ``count``."""

    def check(d: Any) -> bool:
        shown, text = dead_shown(d)
        return shown == rows and count in text

    try:
        await see(driver, check, f"{len(rows)} dead rows and {count!r}", MOVE_S)
    except Exception:
        shown, text = await on_page(dead_shown, driver)
        raise AssertionError(f"shown: {len(shown)} rows from {shown[:1]}, {text!r}") from None


async def make_dead_jobs(client: relay.Client, queue: str, n: int) -> list[str]:
    """``n`` dead jobs, oldest first (by job id)."""
    results = await client.submit_batch([relay.job_fields(queue, {"n": i}, retries=0)
                                         for i in range(n)])  # fmt: skip
    for job in await client.lease([queue], W, count=n):
        await client.fail(job.job_id, W, job.token, f"failed {job.payload['n']}", retryable=False)
    return [r.job_id for r in results]


@pytest.mark.parametrize("width", [500, 1920])
async def test_dashboard_shows_the_newest_dead_jobs_first_and_pages_to_the_oldest(
    server, browser, width
):
    address = "{}:{}".format(*server.handle.address)
    await on_page(browser.set_window_size, width, 900)
    try:
        async with relay.open_client(address) as client:
            ids = await make_dead_jobs(client, "email", 60)
            newest = ids[::-1]
            await open_page(browser, server, "#/jobs?state=dead")
            await see(browser, status_is("connected"), "connected")
            await shows_dead(browser, newest[:50], "(50 of 60, newest first)")
            assert await on_page(browser.execute_script, FITS_JS)
            newer, older = "#jobs-newer", "#jobs-older"
            assert not await on_page(
                lambda: browser.find_element(By.CSS_SELECTOR, newer).is_enabled()
            )

            # Older: the last ten, the oldest last; Older is then disabled, Newer is not.
            await see(browser, click(older), "Older")
            await shows_dead(browser, newest[50:], "(10 of 60, newest first, page 2)")
            buttons = await on_page(lambda: [browser.find_element(By.CSS_SELECTOR, b).is_enabled()
                                             for b in (newer, older)])  # fmt: skip
            assert buttons == [True, False]
            assert await on_page(browser.execute_script, FITS_JS)

            # Retry and Purge work on that page: it shows what is left of it.
            await see(browser, click(f'{dead_row(ids[0])} button[data-action="retry"]'), "retry")
            await see(browser, click(f'{dead_row(ids[1])} button[data-action="purge"]', True),
                      "purge")  # fmt: skip
            await shows_dead(browser, newest[50:58], "(8 of 58, newest first, page 2)")
            assert (await client.inspect(ids[0])).state == "ready"

            # Newer: the first page again, where a job that dies now comes first.
            await see(browser, click(newer), "Newer")
            await shows_dead(browser, newest[:50], "(50 of 58, newest first)")
            [late] = await make_dead_jobs(client, "reports", 1)
            await shows_dead(browser, [late, *newest[:49]], "(50 of 59, newest first)")
    finally:
        await on_page(browser.set_window_size, 1280, 800)
    assert await on_page(no_console_errors, browser) == []


def token_form(driver: Any) -> bool:
    return driver.find_element(By.ID, "token-form").is_displayed()


def say_token(token: str) -> Callable[[Any], bool]:
    def act(driver: Any) -> bool:
        field = driver.find_element(By.ID, "token")
        field.send_keys(token)
        driver.find_element(By.ID, "token-submit").click()
        return True

    return act


def stored(driver: Any) -> tuple[str | None, int, str]:
    """The token in sessionStorage, how many items localStorage has, the cookies."""
    return driver.execute_script(
        "return [sessionStorage.getItem('relay-trio-token'), localStorage.length, document.cookie]"
    )


async def test_dashboard_asks_for_a_token_and_offers_retry_to_admins_only(tmp_path, browser):
    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=TOKENS)

    async with (
        serving(start, str(tmp_path / "relay.db")) as server,
        relay.open_client("{}:{}".format(*server.handle.address), token=ADMIN) as client,
    ):
        doomed = (await client.submit("email", {"n": 0})).job_id
        [job] = await client.lease(["email"], W)
        await client.fail(doomed, W, job.token, "boom", retryable=False)
        await client.submit("email", {"n": 1})
        await open_page(browser, server, "#/jobs?state=dead")
        await see(browser, status_is("token"), "the token form")
        assert await on_page(token_form, browser)

        await see(browser, say_token(WRONG), "the form")
        await see(browser, lambda d: "refused" in d.find_element(By.ID, "token-note").text,
                  "a refusal")  # fmt: skip
        assert await on_page(stored, browser) == [None, 0, ""]

        await see(browser, say_token(WORKER), "the form")
        await see(browser, status_is("connected"), "connected as worker")
        role = await on_page(lambda: browser.find_element(By.ID, "role").get_attribute("data-role"))
        assert role == "worker"
        await shows_stats(browser, client)
        assert await on_page(stored, browser) == [WORKER, 0, ""]
        # The jobs (jobs_list is a producer's), with no button.
        await see(browser, lambda d: d.find_elements(By.CSS_SELECTOR, dead_row(doomed)),
                  "the dead job, shown to a worker", MOVE_S)  # fmt: skip
        assert await on_page(browser.find_elements, By.CSS_SELECTOR, "button[data-action]") == []
        assert WORKER not in await on_page(lambda: browser.page_source)

        await see(browser, click("#forget"), "forget")
        await see(browser, status_is("token"), "the token form again")
        assert await on_page(stored, browser) == [None, 0, ""]
        await see(browser, say_token(ADMIN), "the form")
        await see(browser, status_is("connected"), "connected as admin")
        buttons = await see(
            browser,
            lambda d: d.find_elements(By.CSS_SELECTOR, f"{dead_row(doomed)} button"),
            "the buttons",
        )
        assert [await on_page(lambda b=b: b.text) for b in buttons] == ["Retry", "Purge"]
        await shows_stats(browser, client)


async def test_dashboard_reconnects_after_a_server_restart(tmp_path, browser):
    db = str(tmp_path / "relay.db")
    async with trio.open_nursery() as nursery:
        first = await start_stoppable(nursery, db, metrics_port=0, ws_port=0)
        async with relay.open_client(first.address) as client:
            await client.submit("email", {"n": 0})
            await open_page(browser, first)
            await see(browser, status_is("connected"), "connected")
            await shows_stats(browser, client, BOUND_S)
        await first.stop()
        await see(browser, status_is("reconnecting"), "reconnecting")
        ports = {"metrics_port": first.handle.metrics_address[1],
                 "ws_port": first.handle.ws_address[1]}  # fmt: skip
        second = await start_stoppable(nursery, db, port=first.port, **ports)
        try:
            async with relay.open_client(second.address) as client:
                await see(browser, status_is("connected"), "connected again")
                await client.submit("email", {"n": 1})
                await shows_stats(browser, client)
                # Watching again: the new connection's events count.
                await see(browser, lambda d: page_rates(d)["email"]["submitted"] == "0.1",
                          "the rate", MOVE_S)  # fmt: skip
        finally:
            await second.stop()


async def test_dashboard_says_when_the_websocket_endpoint_is_off(tmp_path, browser):
    async with serving(
        lambda nursery, db: start_stoppable(nursery, db, metrics_port=0), str(tmp_path / "r.db")
    ) as server:
        await open_page(browser, server)
        await see(browser, status_is("off"), "off")
        text = await on_page(lambda: browser.find_element(By.ID, "status").text)
    assert "WebSocket endpoint is off" in text


# Per queue row: whether it is marked paused, and its button's action ("" for none).
PAUSED_JS = """
const out = {};
for (const row of document.querySelectorAll("#queues tbody tr")) {
  const mark = row.querySelector(".paused-mark");
  const button = row.querySelector("td[data-actions] button");
  out[row.dataset.queue] = [!!mark && !mark.hidden && mark.offsetParent !== null,
                            button ? button.dataset.action : ""];
}
return out;
"""


async def shows_paused(driver: Any, expected: dict[str, list]) -> None:
    await see(driver, lambda d: d.execute_script(PAUSED_JS) == expected,
              f"the queues as {expected}", MOVE_S)  # fmt: skip


async def test_dashboard_marks_paused_queues_and_lets_an_admin_pause_and_resume(server, browser):
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        await client.submit("email", {"n": 0})
        await client.submit("reports", {"n": 0})
        await client.queue_pause("reports")
        await open_page(browser, server)
        await see(browser, status_is("connected"), "connected")
        await shows_paused(browser, {"email": [False, "pause"], "reports": [True, "resume"]})
        await shows_stats(browser, client)  # (the counts of a paused queue as any other's)

        await see(browser, click('#queues button[data-queue="email"]'), "pause email")
        await shows_paused(browser, {"email": [True, "resume"], "reports": [True, "resume"]})
        assert (await client.stats()).paused == ["email", "reports"]
        assert await client.lease(["email"], W) == []

        await see(browser, click('#queues button[data-queue="reports"]'), "resume reports")
        await shows_paused(browser, {"email": [True, "resume"], "reports": [False, "pause"]})
        assert (await client.stats()).paused == ["email"]
        assert len(await client.lease(["reports"], W)) == 1
    assert await on_page(no_console_errors, browser) == []


async def test_dashboard_offers_no_pause_to_a_worker(tmp_path, browser):
    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=TOKENS)

    async with (
        serving(start, str(tmp_path / "relay.db")) as server,
        relay.open_client("{}:{}".format(*server.handle.address), token=ADMIN) as client,
    ):
        await client.submit("email", {"n": 0})
        await client.queue_pause("email")
        await open_page(browser, server)
        await see(browser, status_is("token"), "the token form")
        await see(browser, say_token(WORKER), "the form")
        await see(browser, status_is("connected"), "connected as worker")
        await shows_paused(browser, {"email": [True, ""]})
        await see(browser, click("#forget"), "forget")
        await see(browser, status_is("token"), "the token form again")


# Per queue row: its settings cell's two lines (limits, defaults).
SETTINGS_JS = """
const out = {};
for (const row of document.querySelectorAll("#queues tbody tr")) {
  const cell = row.querySelector("td[data-settings]");
  out[row.dataset.queue] = [cell.querySelector(".limits").textContent,
                            cell.querySelector(".defaults").textContent];
}
return out;
"""


def fill(values: dict[str, str]) -> Callable[[Any], bool]:
    """A condition that types ``values`` into the settings form's fields and saves."""

    def act(driver: Any) -> bool:
        form = driver.find_element(By.ID, "settings-form")
        for name, text in values.items():
            field = form.find_element(By.NAME, name)
            field.clear()
            field.send_keys(text)
        driver.find_element(By.ID, "settings-save").click()
        return True

    return act


async def test_dashboard_shows_queue_settings_and_lets_an_admin_change_them(server, browser):
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        await client.submit("email", {"n": 0})
        await client.submit("reports", {"n": 0})
        await client.queue_config("reports", max_leased=5, rate={"limit": 100, "period_ms": 1000},
                                  default_retries=1)  # fmt: skip
        await open_page(browser, server)
        await see(browser, status_is("connected"), "connected")
        expected = {"email": ["", ""], "reports": ["max leased 5 · rate 100/s", "1 retry"]}
        await see(browser, lambda d: d.execute_script(SETTINGS_JS) == expected,
                  f"the settings {expected}", MOVE_S)  # fmt: skip

        # The form opens with the queue's settings, in queue set's forms.
        await see(browser, click('#queues button[data-edit="reports"]'), "settings of reports")
        shown = await on_page(lambda: {
            name: browser.find_element(By.NAME, name).get_attribute("value")
            for name in ("max_leased", "rate", "default_retries", "default_timeout_ms")
        })  # fmt: skip
        assert shown == {"max_leased": "5", "rate": "100/s", "default_retries": "1",
                         "default_timeout_ms": ""}  # fmt: skip
        # A bad value is refused on the page; nothing is sent.
        await see(browser, fill({"rate": "100"}), "a bad rate")
        note = await see(browser, lambda d: d.find_element(By.ID, "settings-note").text, "a note")
        assert "LIMIT/PERIOD" in note
        # Saved: set, cleared (empty), kept.
        await see(browser, fill({"rate": "", "default_timeout_ms": "30s",
                                 "default_backoff": "exp:1s:5m"}), "save")  # fmt: skip
        expected["reports"] = ["max leased 5", "timeout 30s · 1 retry · backoff exp:1s:5m"]
        await see(browser, lambda d: d.execute_script(SETTINGS_JS) == expected,
                  f"the settings {expected}", MOVE_S)  # fmt: skip
        config = await client.queue_config("reports")
        assert (config.max_leased, config.rate, config.default_timeout_ms) == (5, None, 30_000)
        assert config.default_backoff == {
            "kind": "exponential", "base_ms": 1000, "max_ms": 300_000, "jitter": True,
        }  # fmt: skip
        # The server's refusal is shown, one line.
        await see(browser, click('#queues button[data-edit="email"]'), "settings of email")
        await see(browser, fill({"rate": "1/2d"}), "a period too long")
        note = await see(browser, lambda d: d.find_element(By.ID, "settings-note").text, "a note")
        assert "rate.period_ms" in note
        assert (await client.queue_config("email")).rate is None
    assert await on_page(no_console_errors, browser) == []


async def test_dashboard_offers_no_settings_form_to_a_worker(tmp_path, browser):
    async def start(nursery: trio.Nursery, db: str) -> RunningServer:
        return await start_server(nursery, db, tokens=TOKENS)

    async with (
        serving(start, str(tmp_path / "relay.db")) as server,
        relay.open_client("{}:{}".format(*server.handle.address), token=ADMIN) as client,
    ):
        await client.submit("email", {"n": 0})
        await client.queue_config("email", max_leased=2)
        await open_page(browser, server)
        await see(browser, say_token(WORKER), "the form")
        await see(browser, status_is("connected"), "connected as worker")
        shown = {"email": ["max leased 2", ""]}
        await see(browser, lambda d: d.execute_script(SETTINGS_JS) == shown,
                  "the settings, shown to a worker", MOVE_S)  # fmt: skip
        buttons = await on_page(browser.find_elements, By.CSS_SELECTOR, "button[data-edit]")
        assert buttons and not any([await on_page(b.is_displayed) for b in buttons])


SCHEDULES_JS = """
const out = {};
for (const row of document.querySelectorAll("#schedules tbody tr[data-schedule]")) {
  out[row.dataset.schedule] = [...row.cells].map((td) => td.textContent);
}
return out;
"""


async def test_dashboard_lists_schedules_with_next_runs_in_local_time_and_utc(server, browser):
    address = "{}:{}".format(*server.handle.address)
    async with relay.open_client(address) as client:
        info = await client.schedule_put(
            "nightly", "30 2 * * *", "reports", {}, timezone="Europe/Berlin"
        )
        await client.schedule_put("hourly", "@hourly", "q", 1)
        await client.schedule_pause("hourly")
        await open_page(browser, server)
        await see(browser, status_is("connected"), "connected")
        shown = await see(browser, lambda d: d.execute_script(SCHEDULES_JS) or None,
                          "the schedules", MOVE_S)  # fmt: skip
    assert set(shown) == {"nightly", "hourly"}
    name, cron, queue, local, utc, job, state, buttons = shown["nightly"]
    assert (name, cron, queue, job, state) == (
        "nightly", "30 2 * * * (Europe/Berlin)", "reports", "-", "-",
    )  # fmt: skip
    assert buttons == "Pause" and shown["hourly"][7] == "Resume"  # (no token: an admin)
    assert info.next_at is not None
    import datetime as dt
    from zoneinfo import ZoneInfo

    at = dt.datetime.fromtimestamp(info.next_at / 1000, dt.UTC)
    assert local.startswith(f"{at.astimezone(ZoneInfo('Europe/Berlin')):%Y-%m-%d %H:%M} ")
    assert utc.startswith(f"{at:%Y-%m-%d %H:%M} ")
    assert shown["hourly"][3] == "paused"
    assert await on_page(no_console_errors, browser) == []
