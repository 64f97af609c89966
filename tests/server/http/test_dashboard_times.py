"""The overview's chart of wait and run times: the last hour's mean wait (ready to leased)
and run time (lease to ack or fail) per minute, from the server's history, so that someone
on call sees whether a queue is slower than it was (the counts' charts cannot say). In
headless Chromium against a real server."""

from __future__ import annotations

import trio
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select

import relay
from tests.server.conftest import BOUND_S
from tests.server.http.test_dashboard import (
    MOVE_S,
    W,
    no_console_errors,
    on_page,
    open_page,
    see,
    status_is,
)
from tests.server.http.test_dashboard import browser as browser  # the fixture
from tests.server.http.test_dashboard_views import start_flushing
from tests.worker.helpers import serving

TIMES_JS = """
const f = document.getElementById("chart-times");
return [f.dataset.waitMean, f.dataset.runMean, f.querySelectorAll("svg polyline.wait").length,
        f.querySelector(".peak").textContent];
"""


async def test_the_times_chart_shows_the_hours_mean_wait_and_run_time(tmp_path, browser):
    async with (
        serving(start_flushing, str(tmp_path / "relay.db")) as server,
        relay.open_client("{}:{}".format(*server.handle.address)) as client,
    ):
        for n in range(2):
            await client.submit("email", {"n": n})
        await client.submit("reports", {})
        await trio.sleep(0.3)  # (a wait the history can time: real time, on purpose)
        for job in await client.lease(["email", "reports"], W, count=3):
            await client.ack(job.job_id, W, job.token)
        with trio.fail_after(BOUND_S):
            while sum(p.run_count for p in (await client.history()).points) < 3:  # noqa: ASYNC110
                await trio.sleep(0.05)
        points = (await client.history()).points
        wait = round(sum(p.wait_sum_ms for p in points) / sum(p.wait_count for p in points))
        run = round(sum(p.run_sum_ms for p in points) / sum(p.run_count for p in points))
        assert wait >= 300
        await open_page(browser, server)
        await see(browser, status_is("connected"), "connected")
        shown = await see(browser, lambda d: (v := d.execute_script(TIMES_JS))[0] == str(wait)
                          and v, "the hour's mean wait", MOVE_S)  # fmt: skip
        assert shown[1] == str(run) and shown[2] >= 1, shown
        assert "mean this hour" in shown[3], shown
        # One queue's: its own times.
        [mine] = [p for p in (await client.history("reports")).points if p.wait_count]
        await see(browser, lambda d: Select(d.find_element(By.ID, "chart-queue")).select_by_value(
            "reports") or True, "reports")  # fmt: skip
        await see(browser, lambda d: d.execute_script(TIMES_JS)[0] == str(mine.wait_sum_ms),
                  "the wait of reports", MOVE_S)  # fmt: skip
    assert await on_page(no_console_errors, browser) == []
