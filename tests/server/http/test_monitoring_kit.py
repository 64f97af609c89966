"""docs/monitoring/: the Prometheus alert rules pass ``promtool check rules`` and their unit
tests (relay-alerts.test.yml), and every metric the rules and the Grafana dashboard name is
one a running server exposes, once it has done the work that makes each appear.

These tests never skip: without promtool (Debian's ``prometheus`` package, which .ci/run
installs) they fail.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

import relay
from relay.client.client import Client
from relay.protocol import wire

from ..conftest import BOUND_S, serving, start_server
from ..test_lifecycle import scrape

KIT = Path(__file__).parents[3] / "docs" / "monitoring"
RULES = KIT / "relay-alerts.yml"
RULE_TESTS = KIT / "relay-alerts.test.yml"
DASHBOARD = KIT / "grafana-relay.json"

# Names made by Prometheus, not by the server.
PROMETHEUS_OWN = {"up"}
# Series that follow the history's writes (every 5 s): a scrape may wait that long.
HISTORY_WRITE_S = 5.0

# A name followed by `{`, or any name that starts with relay_ (not inside a string: label
# values and the legend's text are no metrics).
_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{")
_RELAY = re.compile(r"\b(relay_[a-zA-Z0-9_:]*)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail(
            "promtool not found: install Debian's prometheus package (apt-get install "
            "prometheus; .ci/run does). The monitoring kit's tests do not skip.",
            pytrace=False,
        )
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    bare = _STRING.sub('""', expr)
    return {*_SELECTOR.findall(bare), *_RELAY.findall(bare)} - PROMETHEUS_OWN


def rule_fields(key: str, text: str | None = None) -> list[str]:
    """The values of ``key`` in the rules file (or ``text``), in order: on its line, or the
    block (``|``, ``>-``) indented under it. No YAML library: the project has none, and
    promtool (above) reads the file for real."""
    lines = (RULES.read_text() if text is None else text).splitlines()
    values = []
    for n, line in enumerate(lines):
        match = re.match(rf"^(\s*)(?:- )?{key}: ?(.*)$", line)
        if match is None:
            continue
        indent, value = len(match[1]), match[2].strip()
        if value in ("|", ">-", ">"):
            block = []
            for more in lines[n + 1 :]:
                if more.strip() and len(more) - len(more.lstrip()) <= indent:
                    break
                block.append(more.strip())
            value = " ".join(part for part in block if part)
        values.append(value)
    return values


def rule_expressions() -> list[str]:
    return rule_fields("expr")


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dashboard["panels"]:
        exprs += [target["expr"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def test_the_alert_rules_pass_promtool_check():
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout


def test_each_alert_fires_and_stays_quiet_as_its_unit_tests_say():
    done = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    # Each alert fires in a test case (an alertname followed by expected alerts), and is
    # quiet in one before it.
    cases = re.findall(r"alertname: (\w+)\n\s*exp_alerts:( \[\])?", RULE_TESTS.read_text())
    assert {name for name, quiet in cases if not quiet} == set(rule_fields("alert"))
    assert {name for name, quiet in cases if quiet} == set(rule_fields("alert"))


def test_every_alert_says_how_bad_and_what_to_do():
    alerts = rule_fields("alert")
    assert len(alerts) == 7
    for key in ("expr", "for", "severity", "summary", "description"):
        assert len(rule_fields(key)) == len(alerts), key
    assert set(rule_fields("severity")) == {"critical", "warning"}
    assert all(len(text) > 80 for text in rule_fields("description"))


def test_the_dashboard_takes_its_data_source_and_queues_as_variables():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["queue"]["type"] == "query" and variables["queue"]["includeAll"]
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
    queue_panels = [p for p in panels if any("queue=~" in t["expr"] for t in p["targets"])]
    assert len(queue_panels) > len(panels) // 2


def test_the_dashboards_queries_are_promql_that_promtool_accepts(tmp_path):
    """Each panel's query, its Grafana variables given values, as a recording rule that
    ``promtool check rules`` parses (JSON is YAML)."""
    targets = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"]
               for target in panel.get("targets", [])]  # fmt: skip
    assert len(targets) > 20
    values = {"$__rate_interval": "1m", "$queue": ".*"}
    rules = []
    for n, expr in enumerate(targets):
        for variable, value in values.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:query_{n}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_names_are_read_out_of_promql():
    expr = ('histogram_quantile(0.95, sum by (queue, le) (rate(relay_job_run_seconds_bucket'
            '{queue=~"$queue"}[$__rate_interval]))) > 0 unless on (queue) up{job="relay"} '
            '== 0 and relay_workers and label_values(relay_queue_jobs, queue) and '
            'foo_bar{a="relay_not_a_metric{"}')  # fmt: skip
    assert metric_names(expr) == {
        "relay_job_run_seconds_bucket", "relay_workers", "relay_queue_jobs", "foo_bar",
    }  # fmt: skip


async def work(client: Client, worker: Client) -> None:
    """What makes every series the kit reads appear: jobs in each state (one dead), a
    worker connected (it keeps its connection), limits and a pause, a schedule that makes
    jobs and one whose queue refuses its slots."""
    for n in range(3):
        await client.submit("email", {"n": n})
    await client.submit("reports", {}, retries=0)
    await client.submit("full", {})  # its depth is 1: the schedule's slots are refused
    leased = await worker.lease(["reports"], "kit-worker", count=1)
    await worker.fail(leased[0].job_id, "kit-worker", leased[0].token, "boom")  # dead
    done = await worker.lease(["email"], "kit-worker", count=1)
    await worker.ack(done[0].job_id, "kit-worker", done[0].token)
    await worker.lease(["email"], "kit-worker", count=1)  # holds it
    await client.queue_config("email", max_leased=5, rate={"limit": 10, "period_ms": 1000})
    await client.queue_pause("full")
    await client.schedule_put("tick", "* * * * * *", "ticks", {})
    await client.schedule_put("refused", "* * * * * *", "full", {})


async def test_every_metric_the_kit_names_is_exposed_by_a_running_server(tmp_path):
    names: dict[str, set[str]] = {}
    for where, exprs in (("rules", rule_expressions()), ("dashboard", dashboard_expressions())):
        for expr in exprs:
            for name in metric_names(expr):
                names.setdefault(name, set()).add(where)
    assert {
        "relay_queue_oldest_ready_seconds", "relay_workers", "relay_job_run_seconds_bucket",
        "relay_jobs_dead_total", "relay_schedule_last_run_age_seconds",
    } <= names.keys()  # fmt: skip

    # Schedules every second: their first slots come while the test waits.
    limits = wire.Limits(allow_second_schedules=True)
    start = functools.partial(start_server, queue_depths={"full": 1}, limits=limits)
    async with serving(start, str(tmp_path / "relay.db")) as running:
        host, port = running.handle.address
        address = f"{host}:{port}"
        async with relay.open_client(address) as client, relay.open_client(address) as worker:
            await work(client, worker)
            # The schedules' first slots come within a second, the job times with the
            # history's next write.
            missing = set(names)
            with trio.move_on_after(BOUND_S + HISTORY_WRITE_S):
                while missing:
                    _, samples = await scrape(running)
                    missing = set(names) - {sample.split("{", 1)[0] for sample in samples}
                    if missing:
                        await trio.sleep(0.2)
    assert not missing, "named by the monitoring kit, not exposed by the server: " + ", ".join(
        f"{name} ({' and '.join(sorted(names[name]))})" for name in sorted(missing)
    )
