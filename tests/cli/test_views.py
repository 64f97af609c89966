"""The views render into a console of 100 columns (and a wide one) and say what they should."""

from __future__ import annotations

import io

import attrs
import pytest
from rich.console import Console, RenderableType

from relay.client import DeadPage, JobView, ServerInfo, Stats
from relay.model import ErrorEntry, JobState
from relay_cli import views
from tests.conftest import T0  # 2026-01-01T00:00:00Z

JOB = "job_3445487880000004"


def render(renderable: RenderableType, width: int = 100) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


def stats(**queues: dict[str, int]) -> Stats:
    return Stats(queues=queues, server=ServerInfo(version="0.1.0", uptime_ms=3_723_000,
                                                  connections=2))  # fmt: skip


def counts(**nonzero: int) -> dict[str, int]:
    return {state: nonzero.get(state, 0) for state in views.STATES}


def dead_job(job_id: str = JOB, queue: str = "payments", error: str = "card declined",
             **fields) -> JobView:  # fmt: skip
    defaults = dict(
        job_id=job_id, queue=queue, state=JobState.DEAD, priority="normal",
        payload={"order": 7}, attempt=2, max_attempts=2, created_at=T0,
        errors=[ErrorEntry(1, error, T0 + 1_000), ErrorEntry(2, error, T0 + 2_500)],
        last_error=error, finished_at=T0 + 2_500, worker_id="host:1:abc",
    )  # fmt: skip
    return JobView(**{**defaults, **fields})


# -- values -------------------------------------------------------------------------------


def test_format_time_is_utc_with_millis():
    assert views.format_time(T0 + 1_234) == "2026-01-01 00:00:01.234 UTC"
    assert views.format_time(T0 + 1_234, millis=False) == "2026-01-01 00:00:01 UTC"
    assert views.format_time(None) == "-"


@pytest.mark.parametrize(
    ("ms", "text"),
    [(350, "350 ms"), (4_200, "4.2 s"), (123_000, "2m 03s"), (3_723_000, "1h 02m 03s"),
     (273_900_000, "3d 04h 05m")],
)  # fmt: skip
def test_format_duration(ms, text):
    assert views.format_duration(ms) == text


def test_truncate_keeps_short_first_lines_and_cuts_the_rest():
    assert views.truncate("short") == "short"
    assert views.truncate(None) == ""
    assert views.truncate("x" * 100, 10) == "x" * 9 + "…"
    assert views.truncate("first line\nTraceback...", 60) == "first line…"


def test_totals_and_unfinished_count_every_state_over_every_queue():
    s = stats(a=counts(ready=2, dead=1), b=counts(leased=1, succeeded=5, retrying=3))
    assert views.totals_by_state(s) == {
        "pending": 0, "ready": 2, "leased": 1, "retrying": 3, "succeeded": 5, "dead": 1,
    }  # fmt: skip
    assert views.unfinished(s) == 6
    assert views.unfinished(stats()) == 0


# -- stats --------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [80, 100, 200])
def test_stats_table_shows_queues_by_state_with_totals_and_server(width):
    s = stats(
        thumbnails=counts(pending=4, ready=3, leased=2, retrying=1, succeeded=120, dead=7),
        email=counts(ready=10, succeeded=5),
    )
    text = render(views.stats_table(s), width)
    for state in views.STATES:
        assert state in text
    assert "…" not in text  # nothing cut, also in a terminal of 80 columns
    assert max(map(len, text.splitlines())) <= width
    lines = text.splitlines()
    email = next(line for line in lines if "email" in line).split()
    assert [w for w in email if w.isdigit()] == ["0", "10", "0", "0", "5", "0", "15"]
    thumbs = next(line for line in lines if "thumbnails" in line).split()
    assert [w for w in thumbs if w.isdigit()] == ["4", "3", "2", "1", "120", "7", "137"]
    total = next(line for line in lines if "total" in line and "pending" not in line).split()
    assert [w for w in total if w.isdigit()] == ["4", "13", "2", "1", "125", "7", "152"]
    # Queues sorted by name, the totals row last.
    assert text.index("email") < text.index("thumbnails") < text.rindex("total")
    assert "relay-trio 0.1.0" in text and "up 1h 02m 03s" in text and "2 connections" in text


def test_stats_table_fits_80_columns_with_counts_in_the_millions():
    s = stats(
        **{
            "thumbnails.resize": counts(
                pending=12_345_678, ready=9_876_543, leased=1_000_000, retrying=5,
                succeeded=987_654_321_000, dead=70_000_000,
            ),
            "email": counts(ready=1_234_567, succeeded=999_999),
        }
    )  # fmt: skip
    s = attrs.evolve(s, oldest_ready_ms={"email": 26 * 3_600_000 + 5 * 60_000})
    text = render(views.stats_table(s), 80)
    assert "…" not in text and max(map(len, text.splitlines())) <= 80
    # Every queue shown: a long name folds within its column rather than vanishing.
    first_column = "".join(line[:14].strip() for line in text.splitlines())
    assert "email" in first_column and "thumbnails.resize" in first_column
    email = next(line for line in text.splitlines() if "email" in line).split()
    assert email[1:] == ["0", "1.23M", "0", "0", "999999", "0", "2.23M", "1d", "02h"]
    for shown in ("12.3M", "9.87M", "1.00M", "987G", "70.0M"):
        assert shown in text
    assert "queue" in text and "total" in text


@pytest.mark.parametrize(
    ("n", "shown"),
    [(0, "0"), (999_999, "999999"), (1_000_000, "1.00M"), (1_999_999, "1.99M"),
     (12_345_678, "12.3M"), (999_999_999, "999M"), (10**9, "1.00G"), (5 * 10**13, "50.0T")],
)  # fmt: skip
def test_short_number_truncates_to_three_figures(n, shown):
    assert views.short_number(n) == shown


def test_stats_table_without_queues_says_so():
    text = render(views.stats_table(stats()))
    assert "no jobs yet" in text
    total = next(line for line in text.splitlines() if "total" in line and "pending" not in line)
    assert [w for w in total.split() if w.isdigit()] == ["0"] * 7


# -- dead jobs ----------------------------------------------------------------------------


def test_dead_table_rows_show_id_queue_attempts_error_and_time():
    page = DeadPage([dead_job(), dead_job("job_3445487880000005", "webhooks", "410 Gone",
                                          attempt=1, max_attempts=1)], None)  # fmt: skip
    text = render(views.dead_table(page))
    assert "Dead jobs" in text
    row = next(line for line in text.splitlines() if JOB in line)
    assert "payments" in row and "2/2" in row and "card declined" in row
    assert "2026-01-01 00:00:02" in row
    other = next(line for line in text.splitlines() if "job_3445487880000005" in line)
    assert "webhooks" in other and "1/1" in other and "410 Gone" in other
    assert "--cursor" not in text


def test_dead_table_truncates_long_errors_to_one_line():
    long_error = "RuntimeError: " + "the upstream said no " * 10 + "\n  File x.py, line 3"
    page = DeadPage([dead_job(error=long_error)], next_cursor=JOB)
    wide = render(views.dead_table(page), 200)
    row = next(line for line in wide.splitlines() if JOB in line)
    assert views.truncate(long_error) in row  # the first 59 characters and "…"
    assert len(views.truncate(long_error)) == views.ERROR_CHARS
    assert "File x.py" not in wide
    # At 100 columns the error gives way further; the id and the time stay whole.
    narrow = render(views.dead_table(page), 100)
    row = next(line for line in narrow.splitlines() if JOB in line)
    assert "RuntimeError: the" in row and "…" in row and "2026-01-01 00:00:02" in row
    assert all(len(line) <= 100 for line in narrow.splitlines())
    assert f"--cursor {JOB}" in narrow


def test_dead_table_falls_back_to_the_last_error_time_and_says_when_empty():
    job = dead_job(finished_at=None)
    assert views.failed_at(job) == T0 + 2_500
    assert "no dead jobs" in render(views.dead_table(DeadPage([], None)))


# -- one job ------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [100, 200])
def test_job_panel_shows_fields_timings_errors_payload_and_result(width):
    job = dead_job(
        state=JobState.SUCCEEDED, priority="critical", attempt=3, max_attempts=4,
        ready_at=T0 + 2_800, idempotency_key="order-7", result={"charged": 1250},
        errors=[ErrorEntry(1, "DemoFailure: card declined", T0 + 1_000),
                ErrorEntry(2, "DemoFailure: gateway timeout", T0 + 2_500)],
        last_error="DemoFailure: gateway timeout", finished_at=T0 + 3_100,
    )  # fmt: skip
    text = render(views.job_panel(job), width)
    assert JOB in text
    for fragment in ("succeeded", "payments", "critical", "3 of 4", "host:1:abc", "order-7"):
        assert fragment in text
    # Timings: readable UTC with the raw milliseconds.
    assert "2026-01-01 00:00:00.000 UTC" in text and f"({T0})" in text
    assert "2026-01-01 00:00:03.100 UTC" in text and f"({T0 + 3_100})" in text
    assert "3.1 s" in text  # total time
    # The error history, one row per attempt.
    assert "card declined" in text and "gateway timeout" in text
    assert "00:00:01.000" in text and "00:00:02.500" in text
    # Payload and result as pretty JSON.
    assert '"order": 7' in text and '"charged": 1250' in text


def test_job_panel_of_a_fresh_job_leaves_out_what_it_does_not_have():
    job = JobView(job_id=JOB, queue="email", state=JobState.READY, priority="normal",
                  payload=[1, "two"], attempt=0, max_attempts=4, created_at=T0)  # fmt: skip
    text = render(views.job_panel(job))
    assert "ready" in text and "0 of 4" in text and '"two"' in text
    for absent in ("errors", "result", "last error", "worker", "finished", "lease expires"):
        assert absent not in text, absent


# -- demo progress ------------------------------------------------------------------------


def test_state_progress_has_a_bar_per_state_out_of_every_job():
    console = Console(file=io.StringIO(), width=100, color_system=None)
    progress, tasks = views.state_progress(console)
    assert list(tasks) == list(views.STATES)
    views.update_state_progress(progress, tasks, stats(
        a=counts(ready=2, succeeded=5), b=counts(dead=3)
    ))  # fmt: skip
    by_state = {state: progress.tasks[task] for state, task in tasks.items()}
    assert by_state["succeeded"].completed == 5 and by_state["succeeded"].total == 10
    assert by_state["dead"].completed == 3 and by_state["pending"].completed == 0
    text = render(progress.make_tasks_table(progress.tasks))
    assert "succeeded" in text and "5/10" in text and "3/10" in text
