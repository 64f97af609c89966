"""Headless Chromium for the dashboard's tests and the README's screenshots.

Debian's ``chromium`` and ``chromium-driver`` packages, driven with Selenium (the ``test``
extra). The driver is always the system's ``/usr/bin/chromedriver``, never one Selenium
would download: the machine's browser and driver come from the same package source, and
CI installs them (``.ci/run``).

Selenium calls block; trio code runs them in a thread (``trio.to_thread.run_sync``), one
at a time per browser.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException, StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
INSTALL = "apt-get install -y --no-install-recommends chromium chromium-driver"
# How often a bounded wait looks at the page: well under the 2 s the dashboard has to
# show a job's move, so that a wait measures the page, not its own polling.
POLL_S = 0.05


class BrowserMissing(RuntimeError):
    """Chromium or its driver is not installed where Debian puts them."""


def missing() -> str | None:
    """Why the browser cannot start (a sentence with the fix), or None."""
    absent = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if not absent:
        return None
    return f"{' and '.join(absent)} not found: install Debian's browser ({INSTALL})"


def open_browser(width: int = 1280, height: int = 800) -> webdriver.Chrome:
    """A headless Chromium with a ``width`` x ``height`` window. The caller quits it.
    Raises BrowserMissing if the browser or its driver is not installed."""
    if (why := missing()) is not None:
        raise BrowserMissing(why)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",  # runs as root in containers and CI
        "--disable-dev-shm-usage",  # a small /dev/shm in containers
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def wait_for(
    driver: webdriver.Chrome, condition: Callable[[webdriver.Chrome], Any], within: float,
    what: str,
) -> Any:  # fmt: skip
    """Poll ``condition`` until it returns something truthy (returned); TimeoutException
    naming ``what`` after ``within`` seconds. An element missing or replaced (the page
    redrew it), or a dialog not there yet, means not yet."""
    return WebDriverWait(driver, within, poll_frequency=POLL_S, ignored_exceptions=IGNORED).until(
        condition, f"{what} not seen within {within} s"
    )


IGNORED = (StaleElementReferenceException, NoAlertPresentException)
# The dashboard's queue table, read from its data attributes: queue -> state -> count.
COUNTS_JS = """
const out = {};
for (const td of document.querySelectorAll("#queues td[data-state]")) {
  (out[td.dataset.queue] ||= {})[td.dataset.state] = Number(td.textContent.replace(/,/g, ""));
}
return out;
"""
# queue -> kind (submitted, succeeded, failed) -> the rate shown, as text.
RATES_JS = """
const out = {};
for (const td of document.querySelectorAll("#queues td[data-rate]")) {
  (out[td.dataset.queue] ||= {})[td.dataset.rate] = td.textContent;
}
return out;
"""
# queue -> how long its oldest ready job has waited, as shown ("-": none ready).
OLDEST_JS = """
const out = {};
for (const td of document.querySelectorAll("#queues td[data-oldest]")) {
  out[td.dataset.queue] = td.textContent;
}
return out;
"""


def page_counts(driver: webdriver.Chrome) -> dict[str, dict[str, int]]:
    return driver.execute_script(COUNTS_JS)


def page_rates(driver: webdriver.Chrome) -> dict[str, dict[str, str]]:
    return driver.execute_script(RATES_JS)


def page_oldest(driver: webdriver.Chrome) -> dict[str, str]:
    return driver.execute_script(OLDEST_JS)


def page_status(driver: webdriver.Chrome) -> str:
    return driver.find_element(By.ID, "status").get_attribute("data-status") or ""


def screenshot_svg(driver: webdriver.Chrome, svg: str, path: str | Path) -> None:
    """Write a PNG of ``svg`` (e.g. a rich Console's ``export_svg()``) to ``path``: the
    SVG in a page of its own, screenshot at its own size."""
    page = (
        "<!doctype html><meta charset='utf-8'><title>svg</title>"
        "<style>html,body{margin:0;background:#fff}svg{display:block}</style>" + svg
    )
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "svg.html"
        file.write_text(page, encoding="utf-8")
        driver.get(file.as_uri())
        element = driver.find_element(By.TAG_NAME, "svg")
        # The whole SVG in the window: an element screenshot is cut at the viewport.
        size = element.size
        driver.set_window_size(int(size["width"]) + 100, int(size["height"]) + 200)
        Path(path).write_bytes(element.screenshot_as_png)
