"""The README's screenshots, taken from a real server with real traffic.

    .venv/bin/python -m relay_scripts.screenshots [OUT_DIR]      # default: docs/

Starts a server on a temporary database (on 127.0.0.1:7400-7402 when they are free, else
on any free ports), submits jobs to three queues for a few seconds while two workers run
them (some fail and retry, two fail for good), and meanwhile follows it three ways:

- the dashboard page (GET / on the metrics listener) in headless Chromium, each view at
  PAGE_WIDTH px: ``dashboard.png`` (the overview, once it shows rates and its charts have
  jobs), ``dashboard-jobs.png`` (the dead jobs), ``dashboard-job.png`` (one dead job and its
  attempts), ``dashboard-workers.png``; and
  ``dashboard-narrow.png``, the jobs at NARROW_WIDTH px (a phone: stacked rows);
- ``top.png``: ``relay-trio top``'s view (cli/top.py), fed by the same server, drawn into
  a recording rich Console of TOP_WIDTH columns and exported as SVG, then screenshot in
  Chromium;
- ``watch.png``: the first lines that ``relay-trio watch --queue email`` (the command, in
  a subprocess) printed, drawn the same way.

Needs Debian's chromium and chromium-driver (scripts/browser.py).
"""

from __future__ import annotations

import io
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.highlighter import JSONHighlighter
from rich.text import Text

import relay
from relay.client.client import job_fields
from relay.server.serve import ServerConfig, ServerHandle, serve
from relay_cli.top import TopView, _follow
from relay_scripts.browser import open_browser, page_rates, screenshot_svg, wait_for

DEFAULT_PORTS = (7400, 7401, 7402)  # jobs, metrics, WebSocket: what a reader would see
TRAFFIC_S = 8.0  # long enough for the rates over 10 s to show
WATCH_LINES = 10
WIDTH = 132  # columns: the watch lines (JSON) unwrapped
# Columns of the top view: a terminal a little wider than 80, where every count shows.
TOP_WIDTH = 100
PAGE_WIDTH = 1280
NARROW_WIDTH = 500
# The tallest a view's shot is: below, it is cut (the PNGs stay small).
PAGE_HEIGHT_MAX = 1400
# The dashboard's shots: (file, hash route, what shows once it is drawn, window width).
VIEWS = (
    ("dashboard.png", "#/overview", "#chart-hour rect.succeeded", PAGE_WIDTH),
    ("dashboard-jobs.png", "#/jobs?state=dead", "#jobs tr[data-job]", PAGE_WIDTH),
    ("dashboard-job.png", None, "#attempts tr[data-attempt]", PAGE_WIDTH),
    ("dashboard-workers.png", "#/workers", "#workers tr[data-worker]", PAGE_WIDTH),
    ("dashboard-narrow.png", "#/jobs?state=dead", "#jobs tr[data-job]", NARROW_WIDTH),
)
BOUND_S = 30.0


async def start(nursery: trio.Nursery, db: str) -> ServerHandle:
    """A server on the default ports if they are free, else on any."""
    for jobs, metrics, ws in (DEFAULT_PORTS, (0, 0, 0)):
        config = ServerConfig(db=db, port=jobs, metrics_port=metrics, ws_port=ws,
                              shutdown_timeout_ms=2000)  # fmt: skip
        try:
            return await nursery.start(serve, config)
        except OSError:
            if jobs == 0:
                raise
    raise AssertionError("unreachable")


async def handler(job: relay.LeasedJob) -> Any:
    """Sleeps ``ms``; raises ``fail`` in its first ``fails`` attempts (default: all)."""
    await trio.sleep(job.payload.get("ms", 20) / 1000)
    if "fail" in job.payload and job.attempt <= job.payload.get("fails", job.attempt):
        raise RuntimeError(job.payload["fail"])
    return {"ok": True}


async def traffic(client: relay.Client) -> None:
    """Jobs for three queues, every 100 ms until cancelled: thumbnails many and quick,
    email a few (every ninth fails once, then succeeds on retry), reports slow enough to
    queue up; one email and one report fail for good."""
    await client.submit("email", {"fail": "SMTPRecipientsRefused: 550 5.1.1 <ada@example.com> "
                                  "mailbox unavailable"}, retries=0)  # fmt: skip
    await client.submit("reports", {"fail": "TimeoutError: warehouse query took over 30 s"},
                        retries=0)  # fmt: skip
    for tick in itertools.count():
        await client.submit_batch([
            job_fields("thumbnails", {"image": f"img-{tick}-{n}.jpg", "ms": 15}) for n in range(3)
        ])  # fmt: skip
        if tick % 3 == 0:
            payload: dict[str, Any] = {"to": f"user{tick}@example.com", "ms": 40}
            if tick % 27 == 0:  # fails once, then succeeds
                payload.update(fail="smtp.example.com closed the connection", fails=1)
            await client.submit("email", payload, backoff={"kind": "fixed", "delay_ms": 500})
        if tick % 4 == 0:
            await client.submit("reports", {"day": f"2026-11-{tick % 28 + 1:02}", "ms": 600})
        await trio.sleep(0.1)


async def watchers(metrics: tuple[str, int]) -> float:
    """``relay_watchers`` from GET /metrics."""
    stream = await trio.open_tcp_stream(*metrics)
    async with stream:
        await stream.send_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    found = re.search(rb"^relay_watchers (\S+)$", data, re.M)
    return float(found.group(1)) if found else 0.0


async def collect_watch(address: str, lines: list[str]) -> None:
    """Run ``relay-trio watch --queue email`` and keep its first WATCH_LINES lines."""
    command = [str(Path(sys.executable).with_name("relay-trio")), "watch", "--queue", "email",
               "--address", address]  # fmt: skip
    proc = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        buffer = b""
        while len(lines) < WATCH_LINES:
            data = await proc.stdout.receive_some(65536)
            if not data:
                break
            buffer += data
            *done, buffer = buffer.split(b"\n")
            lines += [line.decode() for line in done][: WATCH_LINES - len(lines)]
    finally:
        proc.kill()  # our own child, by its handle
        with trio.CancelScope(shield=True), trio.move_on_after(BOUND_S):
            await proc.wait()
        await proc.stdout.aclose()


def terminal_svg(renderables: list[Any], title: str, width: int = WIDTH) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor")  # fmt: skip
    for renderable in renderables:
        console.print(renderable)
    svg = console.export_svg(title=title)
    # rich names a web font; nothing here is loaded from the internet: the local monospace.
    return re.sub(r"@font-face\s*\{[^}]*\}", "", svg)


def shoot_dashboard(driver: Any, out: Path) -> None:
    """Each view of the open page (VIEWS), once it shows what it is for, at its full
    height up to PAGE_HEIGHT_MAX. The job view shows the newest dead job (its traceback
    closed: it names this machine's paths)."""

    def ready(d: Any) -> bool:
        rates = page_rates(d)
        dead = d.find_elements("css selector", "#jobs tbody tr")
        return len(dead) >= 2 and all(
            rates.get(q, {}).get("submitted", "0.0") != "0.0" for q in ("email", "thumbnails")
        )

    driver.execute_script("location.hash = '#/jobs?state=dead'")
    wait_for(driver, ready, BOUND_S, "rates and two dead jobs")
    dead = driver.find_element("css selector", "#jobs tr[data-job]").get_attribute("data-job")
    for name, route, drawn, width in VIEWS:
        driver.set_window_size(width, 800)
        driver.execute_script("location.hash = arguments[0]", route or f"#/job/{dead}")
        wait_for(driver, lambda d, s=drawn: d.find_elements("css selector", s), BOUND_S, name)
        driver.set_window_size(width, PAGE_HEIGHT_MAX)
        # The content's height, and the window's own (outer less inner) beside it.
        height, chrome = driver.execute_script(
            "return [Math.ceil(document.querySelector('main').getBoundingClientRect().bottom"
            " + scrollY) + 16, outerHeight - innerHeight]"
        )
        driver.set_window_size(width, min(height, PAGE_HEIGHT_MAX) + chrome)
        driver.save_screenshot(str(out / name))


async def main(out: Path) -> None:
    await trio.to_thread.run_sync(lambda: out.mkdir(parents=True, exist_ok=True))
    driver = await trio.to_thread.run_sync(open_browser, PAGE_WIDTH, 800)
    try:
        with tempfile.TemporaryDirectory() as tmp, trio.fail_after(BOUND_S * 3):
            async with trio.open_nursery() as nursery:
                handle = await start(nursery, str(Path(tmp) / "relay.db"))
                address = "{}:{}".format(*handle.address)
                metrics = "http://{}:{}/".format(*handle.metrics_address)
                watched: list[str] = []
                nursery.start_soon(collect_watch, address, watched)
                # The command (another process) watches once /metrics counts it.
                while not await watchers(handle.metrics_address):  # noqa: ASYNC110
                    await trio.sleep(0.05)
                view = TopView()
                view.status = f"connected to {address}"
                workers = [
                    relay.Worker(address, queues=["email", "thumbnails"], handler=handler,
                                 concurrency=8),
                    relay.Worker(address, queues=["reports"], handler=handler, concurrency=1),
                ]  # fmt: skip
                async with relay.open_client(address) as client, trio.open_nursery() as work:
                    work.start_soon(_follow, client, view)
                    for worker in workers:
                        await work.start(worker.run)
                    await trio.to_thread.run_sync(driver.get, metrics)
                    work.start_soon(traffic, client)
                    await trio.sleep(TRAFFIC_S)  # the traffic goes on while the shots are taken
                    await trio.to_thread.run_sync(shoot_dashboard, driver, out)
                    top = terminal_svg([view.render()], "relay-trio top", TOP_WIDTH)
                    work.cancel_scope.cancel()  # traffic, workers and top's feed: the end
                with trio.fail_after(BOUND_S):
                    while len(watched) < WATCH_LINES:  # noqa: ASYNC110 (the subprocess's lines)
                        await trio.sleep(0.05)
                prompt = Text("$ relay-trio watch --queue email", style="bold")
                lines = [JSONHighlighter()(line) for line in watched]
                watch = terminal_svg([prompt, *lines, Text("^C", style="dim")], "relay-trio watch")
                handle.shutdown()
        for name, svg in (("top.png", top), ("watch.png", watch)):
            await trio.to_thread.run_sync(screenshot_svg, driver, svg, out / name)
    finally:
        await trio.to_thread.run_sync(driver.quit)
    for name in (*(view[0] for view in VIEWS), "top.png", "watch.png"):
        print(f"{out / name}: {(out / name).stat().st_size // 1024} KiB")


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1] if len(sys.argv) > 1 else "docs"))
