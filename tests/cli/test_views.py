"""The views render into consoles of 80, 120 and 200 columns and say what they should: one
line per row, numbers, ids and headers whole, the rest of the width to queue names and
errors, no line wider than the console or ending in spaces."""

from __future__ import annotations

import io
import subprocess

import attrs
import pytest
from hypothesis import given, strategies
from rich.cells import cell_len
from rich.console import Console, RenderableType

from relay.client.client import (
    DeadPage,
    History,
    HistoryPoint,
    JobsPage,
    JobSummary,
    JobView,
    QueueConfig,
    QueueInfo,
    QueuePage,
    ServerInfo,
    Stats,
)
from relay.protocol.model import (
    ID_SEQ_BITS,
    AttemptEntry,
    AttemptOutcome,
    ErrorEntry,
    JobState,
    format_job_id,
)
from relay_cli import views
from tests.conftest import T0  # 2026-01-01T00:00:00Z

from .conftest import RELAY, cli_env, relay_trio

JOB = "job_3445487880000004"
WIDTHS = [80, 120, 200]
QUEUE_40 = "billing.invoice-reminders.nightly-run-eu"
QUEUE_128 = ("acme." + "eu-west-1.billing." * 7)[:124] + ".end"
assert (len(QUEUE_40), len(QUEUE_128)) == (40, 128)


# The states a table shows while no job is cancelled (the cancelled column comes with one).
BASE_STATES = [state for state in views.STATES if state not in views.SHOWN_IF_ANY]


def render(renderable: RenderableType, width: int = 100) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


def lines_of(renderable: RenderableType, width: int) -> list[str]:
    """The lines drawn at ``width``, each checked: no wider, no spaces at its end."""
    lines = render(renderable, width).splitlines()
    for line in lines:
        assert cell_len(line) <= width, (width, line)
        assert line == line.rstrip(), f"spaces at the end of {line!r}"
    return lines


def row(lines: list[str], fragment: str) -> str:
    """The one line that holds ``fragment`` (a row drawn on two lines would fail)."""
    found = [line for line in lines if fragment in line]
    assert len(found) == 1, (fragment, found)
    return found[0]


def job_id(ms: int, seq: int = 0) -> str:
    return format_job_id((ms << ID_SEQ_BITS) | seq)


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
    assert views.format_minute(T0 + 61_234) == "2026-01-01 00:01"


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
    assert views.truncate("first line\nTraceback...") == "first line…"
    assert views.truncate("東京 is far", 5) == "東京…"  # cells, not characters


def test_cut_middle_keeps_a_long_names_start_and_end():
    assert views.cut_middle("email", 12) == "email"
    assert views.cut_middle(QUEUE_40, 40) == QUEUE_40
    assert views.cut_middle(QUEUE_40, 21) == "billing.in…tly-run-eu"
    cut = views.cut_middle(QUEUE_128, views.QUEUE_MIN)
    assert len(cut) == views.QUEUE_MIN and cut.startswith("acme.") and cut.endswith(".end")


def test_totals_and_unfinished_count_every_state_over_every_queue():
    s = stats(a=counts(ready=2, dead=1), b=counts(leased=1, succeeded=5, retrying=3))
    assert views.totals_by_state(s) == {
        "pending": 0, "ready": 2, "leased": 1, "retrying": 3, "succeeded": 5, "dead": 1,
        "cancelled": 0,
    }  # fmt: skip
    assert views.unfinished(s) == 6
    assert views.unfinished(stats()) == 0


# -- job ids ------------------------------------------------------------------------------


def test_short_ids_are_the_shortest_prefixes_unique_among_the_ids_given():
    a, b = job_id(T0), job_id(T0 + 3_000)  # 3 s apart: the same first 7 hex digits
    c = job_id(T0 + 86_400_000)  # a day later
    shown = views.short_ids([a, b, c])
    assert shown[c] == c[:11]  # "job_" and the minimum of 7 digits
    assert a[:11] == b[:11]
    digits = next(n for n in range(7, 17) if a[4 : 4 + n] != b[4 : 4 + n])
    assert (shown[a], shown[b]) == (a[: 4 + digits], b[: 4 + digits])
    assert views.short_ids([a]) == {a: a[:11]}


def test_short_ids_of_one_millisecond_are_longer_prefixes_up_to_the_whole_id():
    batch = [job_id(T0, seq) for seq in (1, 2, 0x11, 0x2A)]  # one submit_batch
    other = job_id(T0 + 3_000)
    shown = views.short_ids([*batch, other])
    # ...01 and ...02 differ only in their last digit: both whole; ...11 and ...2a differ
    # from every other in their 15th digit; the id made 3 s later, within its first 8.
    assert [shown[i] for i in batch] == [batch[0], batch[1], batch[2][:19], batch[3][:19]]
    assert shown[other] == other[:12]
    assert not any(i.startswith(shown[other]) for i in batch)


# Job ids as a busy server makes them: milliseconds within ~100 s of each other, many in
# the same few, and up to 300 ids (a batch's sequence numbers) in one millisecond.
_KEYS = strategies.builds(
    lambda ms, seq: (ms << ID_SEQ_BITS) | seq,
    strategies.integers(T0, T0 + 100_000) | strategies.integers(T0, T0 + 3),
    strategies.integers(0, 300),
)


@given(strategies.sets(_KEYS, min_size=1, max_size=40))
def test_short_ids_follow_git_s_rule_so_each_can_be_typed_back(keys):
    """Each id is shown as the shortest start of it, of 7 hex digits at least, that no
    other id shown has: what ``inspect`` with ``prefix`` (and so ``relay-trio inspect``)
    resolves to that one job among them."""
    ids = [format_job_id(key) for key in keys]
    shown = views.short_ids(ids)
    for whole, short in shown.items():
        assert len(short) >= len("job_") + 7
        assert [i for i in ids if i.startswith(short)] == [whole]
        if len(short) > len("job_") + 7:  # one digit fewer would match another id too
            assert len([i for i in ids if i.startswith(short[:-1])]) > 1


def test_short_ids_are_the_servers_where_it_gave_them():
    """``short``: the server's abbreviations (unique among all its jobs, so often longer
    than among the rows); an id it does not name falls back to the rule among the rows."""
    a, b, c = job_id(T0), job_id(T0 + 3_000), job_id(T0 + 86_400_000)
    short = {a: a[:14], c: c[:13], "job_ffff": "unused"}
    assert views.short_ids([a, b, c], short) == {a: a[:14], b: b[:12], c: c[:13]}
    assert views.short_ids([a, b, c], {}) == views.short_ids([a, b, c])


def test_short_ids_leave_other_strings_whole():
    assert views.short_ids(["job_1", "not-an-id", JOB]) == {
        "job_1": "job_1", "not-an-id": "not-an-id", JOB: JOB[:11],
    }  # fmt: skip
    zero = "job_" + "0" * 16  # the first id there can be is one too
    assert views.short_ids([zero, JOB]) == {zero: zero[:11], JOB: JOB[:11]}


# -- stats --------------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_stats_table_shows_queues_by_state_with_totals_and_server(width):
    s = stats(
        thumbnails=counts(pending=4, ready=3, leased=2, retrying=1, succeeded=120, dead=7),
        email=counts(ready=10, succeeded=5),
    )
    lines = lines_of(views.stats_table(s), width)
    text = "\n".join(lines)
    for header in (*BASE_STATES, "queue", "total", "oldest", "ready"):
        assert header in text
    assert "…" not in text  # nothing cut, also in a terminal of 80 columns
    email = row(lines, "email").split()
    assert [w for w in email if w.isdigit()] == ["0", "10", "0", "0", "5", "0", "15"]
    thumbs = row(lines, "thumbnails").split()
    assert [w for w in thumbs if w.isdigit()] == ["4", "3", "2", "1", "120", "7", "137"]
    total = next(line for line in lines if line.startswith("total"))
    assert [w for w in total.split() if w.isdigit()] == ["4", "13", "2", "1", "125", "7", "152"]
    # Queues sorted by name, the totals row last.
    assert text.index("email") < text.index("thumbnails") < text.rindex("total")
    assert "relay-trio 0.1.0" in text and "up 1h 02m 03s" in text and "2 connections" in text
    # Title, two lines of headers, rule, two queues, the blank line, totals, server.
    assert len(lines) == 9


@pytest.mark.parametrize("width", WIDTHS)
def test_stats_table_shows_the_cancelled_column_once_some_job_is_cancelled(width):
    s = stats(email=counts(ready=10, succeeded=5, cancelled=2), other=counts(ready=1))
    lines = lines_of(views.stats_table(s), width)
    assert "cancelled" in "\n".join(lines)
    assert [w for w in row(lines, "email").split() if w.isdigit()] == [
        "0", "10", "0", "0", "5", "0", "2", "17",
    ]  # fmt: skip
    total = next(line for line in lines if line.startswith("total"))
    assert [w for w in total.split() if w.isdigit()] == ["0", "11", "0", "0", "5", "0", "2", "18"]


@pytest.mark.parametrize("width", WIDTHS)
def test_stats_table_says_how_many_queues_the_page_leaves_out(width):
    page = attrs.evolve(stats(a=counts(ready=1), b=counts(ready=2)), next_cursor="b",
                        total_queues=12_000)  # fmt: skip
    text = "\n".join(lines_of(views.stats_table(page), width))
    assert "the first 2 of 12000 queues; --queue NAME for others" in text
    whole = attrs.evolve(page, next_cursor=None, total_queues=2)
    assert "of 2 queues" not in "\n".join(lines_of(views.stats_table(whole), width))


def millions() -> Stats:
    return attrs.evolve(stats(**{
        "thumbnails.resize": counts(
            pending=12_345_678, ready=9_876_543, leased=1_000_000, retrying=5,
            succeeded=987_654_321_000, dead=70_000_000,
        ),
        "email": counts(ready=1_234_567, succeeded=999_999),
        QUEUE_40: counts(ready=250_000, leased=16, succeeded=4_000_000, dead=3),
        QUEUE_128: counts(succeeded=1),
    }), oldest_ready_ms={"email": 26 * 3_600_000 + 5 * 60_000, QUEUE_40: 4_200})  # fmt: skip


@pytest.mark.parametrize("width", WIDTHS)
def test_stats_table_gives_queue_names_the_room_the_counts_leave(width):
    lines = lines_of(views.stats_table(millions()), width)
    assert lines[2].split() == ["queue", *BASE_STATES, "total", "ready"]  # all whole
    email = row(lines, "email ").split()
    assert email[1:] == ["0", "1.23M", "0", "0", "999999", "0", "2.23M", "1d", "02h"]
    for shown in ("12.3M", "9.87M", "1.00M", "987G", "70.0M"):
        assert shown in row(lines, "thumbnails.resize")
    # The counts take at most 63 cells: at 80 columns a name of 17 is whole, and longer
    # ones keep their start and end; at 120, a name of 40.
    long_row = row(lines, "billing.i")
    if width == 80:
        name = long_row.split()[0]
        assert name.startswith("billing.i") and "…" in name and name.endswith("run-eu")
        assert lines[2].index("pending") - 1 >= 17
    else:
        assert QUEUE_40 in long_row
    huge = row(lines, "acme.")
    assert huge.split()[0].endswith(".end") and (QUEUE_128 in huge) == (width == 200)
    assert long_row.split()[1:] == ["0", "250000", "16", "0", "4.00M", "3", "4.25M", "4.2", "s"]


@pytest.mark.parametrize("width", WIDTHS)
def test_stats_table_marks_a_paused_queue_and_keeps_its_counts(width):
    s = attrs.evolve(
        stats(email=counts(ready=10), **{QUEUE_40: counts(ready=2, dead=1)}),
        paused=["email", QUEUE_40],
    )
    lines = lines_of(views.stats_table(s), width)
    email = row(lines, "email")
    assert email.startswith("email paused ")  # room for both: the mark after the name
    assert [w for w in email.split() if w.isdigit()] == ["0", "10", "0", "0", "0", "0", "10"]
    long_row = next(line for line in lines if line.startswith("billing"))
    if width >= 120:
        assert long_row.startswith(f"{QUEUE_40} paused ")
    else:  # no room for the mark: the name first, and a line under the table names it
        assert "paused" not in long_row
        assert f"paused (yellow): {QUEUE_40}" in lines
    assert all(len(line) <= width for line in lines)
    total = next(line for line in lines if line.startswith("total"))
    assert [w for w in total.split() if w.isdigit()] == ["0", "12", "0", "0", "0", "1", "13"]
    assert "paused" not in "\n".join(lines_of(views.stats_table(stats(email=counts())), width))


@pytest.mark.parametrize("width", WIDTHS)
def test_stats_table_marks_a_queue_with_a_limit_and_keeps_its_counts(width):
    s = attrs.evolve(
        stats(email=counts(ready=10), sms=counts(), **{QUEUE_40: counts(ready=2, dead=1)}),
        paused=["email", QUEUE_40],
    )
    lines = lines_of(views.stats_table(s, ["email", "sms", QUEUE_40]), width)
    email = row(lines, "email")
    assert email.startswith("email paused limited ")  # room for both marks
    assert [w for w in email.split() if w.isdigit()] == ["0", "10", "0", "0", "0", "0", "10"]
    assert row(lines, "sms").startswith("sms limited ")
    long_row = next(line for line in lines if line.startswith("billing"))
    if width >= 120:
        assert long_row.startswith(f"{QUEUE_40} paused limited ")
    else:  # no room for the marks: the name first, named under the table as paused
        assert "paused" not in long_row and "limited" not in long_row
        assert f"paused (yellow): {QUEUE_40}" in lines
    # Not limited: no mark.
    assert "limited" not in "\n".join(lines_of(views.stats_table(s), width))


def test_a_limited_queue_whose_mark_has_no_room_is_named_under_the_table():
    s = stats(**{QUEUE_40: counts(ready=2)})
    lines = lines_of(views.stats_table(s, [QUEUE_40]), 80)
    assert "limited" not in next(line for line in lines if line.startswith("billing"))
    assert f"limited (cyan): {QUEUE_40}" in lines


# -- queue list ---------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_queue_table_shows_each_queue_paused_or_not_with_its_counts(width):
    page = QueuePage(
        queues=[
            QueueInfo(QUEUE_40, True, counts=counts(ready=3, dead=1)),
            QueueInfo("email", False, counts=counts(pending=1, ready=12_345_678, succeeded=5)),
            QueueInfo("later", True, counts=counts()),
        ],
        next_cursor=None,
    )
    lines = lines_of(views.queue_table(page), width)
    six = ["pending", "ready", "leased", "retrying", "succeeded", "dead"]  # (no cancelled job)
    assert lines[1].split() == ["queue", "paused", *six, "total"]
    assert row(lines, "email").split() == ["email", "-", "1", "12.3M", "0", "0", "5", "0", "12.3M"]
    assert row(lines, "later").split() == ["later", "paused", *["0"] * 7]
    billing = row(lines, "billing.i").split()
    assert billing[1:] == ["paused", "0", "3", "0", "0", "0", "1", "4"]
    # The numbers leave a name of about 20 whole at 80 columns, 40 and more at 120.
    if width == 80:
        assert "…" in billing[0] and billing[0].endswith("run-eu")
    else:
        assert billing[0] == QUEUE_40
    assert "next page" not in "\n".join(lines)


@pytest.mark.parametrize("width", [80, 120])
def test_queue_table_shows_cancelled_jobs_while_a_queue_has_some(width):
    page = QueuePage(
        queues=[QueueInfo("email", False, counts=counts(ready=2, cancelled=3))], next_cursor=None
    )
    lines = lines_of(views.queue_table(page), width)
    assert lines[1].split() == ["queue", "paused", *views.STATES, "total"]
    assert row(lines, "email").split() == ["email", "-", "0", "2", "0", "0", "0", "0", "3", "5"]
    assert all(len(line) <= width for line in lines)


BACKOFF = {"kind": "exponential", "base_ms": 1000, "max_ms": 300_000, "jitter": True}
EMAIL = QueueInfo("email", False, 5, {"limit": 100, "period_ms": 1000}, 30_000, 3, BACKOFF,
                  counts=counts(ready=4, leased=5, dead=2))  # fmt: skip


@pytest.mark.parametrize("width", WIDTHS)
def test_queue_table_shows_limits_and_defaults_while_the_names_keep_room(width):
    later = QueueInfo("later", False, rate={"limit": 10, "period_ms": 60_000}, counts=counts())
    page = QueuePage(queues=[EMAIL, later], next_cursor=None)
    lines = lines_of(views.queue_table(page), width)
    text = "\n".join(lines)
    if width == 80:  # the defaults' column goes first: the names keep their room
        assert lines[1].split()[:4] == ["queue", "paused", "limits", "pending"]
        assert row(lines, "email").split()[:6] == ["email", "-", "max", "5", "·", "100/s"]
        assert "defaults: relay-trio queue show NAME" in text
    else:
        assert lines[1].split()[:4] == ["queue", "paused", "limits", "defaults"]
        assert "max 5 · 100/s 30s · 3 retries · exp:1s:5m" in row(lines, "email")
        assert row(lines, "later").split()[:4] == ["later", "-", "10/m", "-"]
        assert "queue show" not in text
    # With a long name, at 80 columns both go; the counts stay.
    page = QueuePage(queues=[EMAIL, attrs.evolve(later, queue=QUEUE_40)], next_cursor=None)
    lines = lines_of(views.queue_table(page), width)
    if width == 80:
        assert lines[1].split() == ["queue", "paused", *views.STATES[:-1], "total"]
        assert "limits and defaults: relay-trio queue show NAME" in "\n".join(lines)
    else:
        cells = row(lines, QUEUE_40[:10]).split()
        assert cells[1:4] == ["-", "10/m", "-"]
        assert len(cells[0]) >= views.SETTINGS_ROOM and (width < 200 or cells[0] == QUEUE_40)
    # Without settings, no settings' columns.
    plain = QueuePage(queues=[QueueInfo("a", False, counts=counts(ready=1))], next_cursor=None)
    assert "limits" not in "\n".join(lines_of(views.queue_table(plain), width))


@pytest.mark.parametrize("width", [80, 120])
def test_queue_panel_shows_each_setting_as_queue_set_takes_it_and_the_counts(width):
    lines = lines_of(views.queue_panel(EMAIL), width)
    assert all(cell_len(line) <= 80 for line in lines)
    assert lines[0].startswith("╭─ email ")
    text = "\n".join(lines)
    for shown in ("5 jobs at once", "100/s (leases)", "default timeout  30s",
                  "default retries  3", "default backoff  exp:1s:5m"):  # fmt: skip
        assert shown in text, (shown, text)
    counts_row = lines[-2].strip("│ ").split()
    assert counts_row == ["0", "4", "5", "0", "0", "2", "11"]
    # Nothing set: what applies instead; no counts for ``queue set``'s answer.
    bare = "\n".join(lines_of(views.queue_panel(QueueConfig(QUEUE_128, True)), width))
    assert "- (no limit)" in bare and "- (the submit's, else 3)" in bare
    assert "yes: no worker leases its jobs" in bare and "pending" not in bare
    assert "…" in bare.splitlines()[0]  # a long name, cut in the title


@pytest.mark.parametrize(
    ("rate", "text"),
    [((100, 1000), "100/s"), ((10, 60_000), "10/m"), ((5, 500), "5/500ms"), ((1, 90_000), "1/90s"),
     ((3, 7_200_000), "3/2h"), ((2, 1), "2/ms"), ((7, 10_000), "7/10s")],
)  # fmt: skip
def test_a_rate_is_shown_as_queue_set_takes_it(rate, text):
    from relay_cli.options import parse_rate

    shown = views.rate_text({"limit": rate[0], "period_ms": rate[1]})
    assert shown == text
    assert parse_rate(shown) == {"limit": rate[0], "period_ms": rate[1]}


def test_a_backoff_is_shown_as_queue_set_takes_it():
    from relay_cli.options import parse_backoff

    for backoff in (BACKOFF, {**BACKOFF, "jitter": False, "base_ms": 1500},
                    {"kind": "fixed", "delay_ms": 10_000}):  # fmt: skip
        assert parse_backoff(views.backoff_text(backoff)) == backoff
    assert views.backoff_text(BACKOFF) == "exp:1s:5m"


def test_queue_table_says_where_the_next_page_begins_and_when_there_is_none():
    page = QueuePage(queues=[QueueInfo("a", False, counts=counts(ready=1))], next_cursor="a")
    text = "\n".join(lines_of(views.queue_table(page), 80))
    assert "next page: --cursor a" in text
    empty = "\n".join(lines_of(views.queue_table(QueuePage(queues=[], next_cursor=None)), 80))
    assert "no queues yet" in empty


def test_stats_table_without_queues_says_so():
    lines = lines_of(views.stats_table(stats()), 80)
    assert "no jobs yet" in row(lines, "no jobs yet")
    total = next(line for line in lines if line.startswith("total"))
    assert [w for w in total.split() if w.isdigit()] == ["0"] * 7


@pytest.mark.parametrize(
    ("n", "shown"),
    [(0, "0"), (999_999, "999999"), (1_000_000, "1.00M"), (1_999_999, "1.99M"),
     (12_345_678, "12.3M"), (999_999_999, "999M"), (10**9, "1.00G"), (5 * 10**13, "50.0T")],
)  # fmt: skip
def test_short_number_truncates_to_three_figures(n, shown):
    assert views.short_number(n) == shown


# -- dead jobs ----------------------------------------------------------------------------

ERRORS = {
    "card": "DemoFailure: card declined",
    "timeout": "TimeoutError: warehouse query took over 30 s while computing the nightly "
    "invoice reminders for every tenant\nTraceback (most recent call last):\n  File x.py",
    "smtp": "SMTPRecipientsRefused: 550 5.1.1 <ada@example.com> mailbox unavailable",
    "gone": "endpoint answered 410 Gone",
}


def dead_page() -> DeadPage:
    """Dead jobs as a busy server has them: four of one batch (one millisecond), one made
    3 s later, one a day before; a queue of 40 characters and one of 128."""
    batch = [job_id(T0, seq) for seq in (2, 0x11, 0x17, 0x1C)]
    jobs = [
        dead_job(job_id(T0 - 86_400_000), "email", ERRORS["smtp"], attempt=5, max_attempts=5),
        dead_job(batch[0], "payments", ERRORS["card"]),
        dead_job(batch[1], QUEUE_40, ERRORS["timeout"], attempt=10, max_attempts=10),
        dead_job(batch[2], "webhooks", ERRORS["gone"], attempt=1, max_attempts=1),
        dead_job(batch[3], QUEUE_128, ERRORS["card"], finished_at=T0 + 61_000),
        dead_job(job_id(T0 + 3_000), "payments", ERRORS["card"], finished_at=None),
    ]
    return DeadPage(jobs, next_cursor=jobs[-1].job_id)


# At each width, how much of the first line of an error a row shows at least, beside
# ids of up to 20 characters (the batch's are whole, see short_ids) and the queue of 40
# characters, whole from 120 columns. Queue names of up to QUEUE_WHOLE_AT_80 are whole at
# 80 columns.
ERROR_SHOWN = {80: 19, 120: 31, 200: 200}
QUEUE_WHOLE_AT_80 = 12


@pytest.mark.parametrize("width", WIDTHS)
def test_dead_table_rows_are_one_line_with_short_ids_whole_queues_and_errors(width):
    page = dead_page()
    lines = lines_of(views.dead_table(page), width)
    assert lines[0].strip() == "Dead jobs"
    assert lines[1].split() == ["id", "queue", "tries", "failed", "at", "(UTC)", "last", "error"]
    # Title, headers, rule, a line per job, the next page's cursor.
    assert len(lines) == 3 + len(page.jobs) + 1
    assert lines[-1] == f"more dead jobs: --cursor {page.next_cursor}"
    shown = views.short_ids(job.job_id for job in page.jobs)
    # A day before: 7 digits; 3 s later: 8; the batch's: 15 or 16, whole where two differ
    # only in their last digit (...11 and ...17).
    assert [len(shown[job.job_id]) - len("job_") for job in page.jobs] == [7, 15, 16, 16, 16, 8]
    for job in page.jobs:
        line = row(lines[:-1], shown[job.job_id] + " ")
        assert line.startswith(shown[job.job_id] + " ")
        first = job.last_error.splitlines()[0]
        assert first[: ERROR_SHOWN[width] - 1] in line, (first, line)
        assert f" {job.attempt}/{job.max_attempts} " in line
        assert views.format_minute(views.failed_at(job)) in line
        if len(job.queue) <= QUEUE_WHOLE_AT_80 or (width >= 120 and len(job.queue) <= 40):
            assert f" {job.queue} " in line
        else:  # cut in the middle, its start and end kept
            assert f" {job.queue[:5]}" in line and f"{job.queue[-4:]} " in line
            assert "…" in line.split()[1]
    assert (QUEUE_40 in "\n".join(lines)) == (width >= 120)
    # The error takes the rest of the line, as far as its first line goes.
    timeout = row(lines, "TimeoutError")
    assert cell_len(timeout) == min(width, timeout.index("TimeoutError") + 1 + len(
        ERRORS["timeout"].splitlines()[0]))  # fmt: skip
    assert "Traceback" not in "\n".join(lines)


@pytest.mark.parametrize("width", WIDTHS)
def test_dead_table_shows_whole_ids_when_asked(width):
    page = dead_page()
    lines = lines_of(views.dead_table(page, full_ids=True), width)[:-1]  # not the cursor
    assert len(lines) == 3 + len(page.jobs)
    for job in page.jobs:
        line = row(lines, job.job_id)
        assert line.startswith(job.job_id + "  ")
        assert f" {job.attempt}/{job.max_attempts} " in line
        # At 80 columns the whole ids leave the error 19 characters (the queue, 12).
        assert job.last_error.splitlines()[0][: 18 if width == 80 else 30] in line


@pytest.mark.parametrize("width", WIDTHS)
def test_dead_table_shows_the_ids_as_the_server_abbreviates_them(width):
    # Among all the server's jobs, each id needs more digits than among these rows.
    page = dead_page()
    among_rows = views.short_ids(job.job_id for job in page.jobs)
    short = {job.job_id: job.job_id[: max(len(among_rows[job.job_id]) + 2, 16)]
             for job in page.jobs}  # fmt: skip
    short[page.jobs[1].job_id] = page.jobs[1].job_id  # (a whole id: the widest column)
    lines = lines_of(views.dead_table(page, short=short), width)[:-1]  # not the cursor
    assert len(lines) == 3 + len(page.jobs)
    for job in page.jobs:
        line = row(lines, short[job.job_id] + " ")
        assert line.startswith(short[job.job_id] + " ") and len(line) <= width
        assert f" {job.attempt}/{job.max_attempts} " in line
    whole = lines_of(views.dead_table(page, short=short, full_ids=True), width)
    assert [line.split()[0] for line in whole[3:-1]] == [job.job_id for job in page.jobs]


def test_dead_table_falls_back_to_the_last_error_time_and_says_when_empty():
    job = dead_job(finished_at=None)
    assert views.failed_at(job) == T0 + 2_500
    lines = lines_of(views.dead_table(DeadPage([], None)), 80)
    assert "no dead jobs" in row(lines, "no dead jobs")


# -- the job browser ----------------------------------------------------------------------


def jobs_page() -> JobsPage:
    """A job of each state, in queues of 8, 40 and 128 characters, with a worker's long id
    and a long error."""
    jobs = [
        JobSummary(job_id(T0 + 9_000), "email", JobState.PENDING, "normal", 0, 4, T0 + 9_000,
                   run_at=T0 + 3_600_000),
        JobSummary(job_id(T0 + 8_000), QUEUE_40, JobState.READY, "high", 0, 4, T0 + 8_000,
                   ready_at=T0 + 8_000),
        JobSummary(job_id(T0 + 7_000), "payments", JobState.LEASED, "normal", 1, 4, T0 + 7_000,
                   lease_expires_at=T0 + 37_000, worker_id="host-17.pid-4242.slot-3"),
        JobSummary(job_id(T0 + 6_000), QUEUE_128, JobState.RETRYING, "normal", 2, 4,
                   T0 + 6_000, run_at=T0 + 60_000, last_error=ERRORS["timeout"],
                   worker_id="w1"),
        JobSummary(job_id(T0 + 5_000), "email", JobState.SUCCEEDED, "low", 1, 4, T0 + 5_000,
                   finished_at=T0 + 5_500, worker_id="w1"),
        JobSummary(job_id(T0 + 4_000), "webhooks", JobState.DEAD, "normal", 1, 1, T0 + 4_000,
                   finished_at=T0 + 4_100, last_error=ERRORS["gone"], worker_id="w2"),
        JobSummary(job_id(T0 + 3_000), "email", JobState.CANCELLED, "normal", 0, 4, T0 + 3_000,
                   finished_at=T0 + 3_300),
    ]  # fmt: skip
    return JobsPage(jobs, next_cursor=jobs[-1].job_id)


@pytest.mark.parametrize("width", WIDTHS)
def test_jobs_table_rows_are_one_line_with_state_time_and_error(width):
    page = jobs_page()
    lines = lines_of(views.jobs_table(page), width)
    assert lines[0].strip() == "Jobs"
    headers = ["id", "queue", "state", "tries", "at", "(UTC)", "last", "error"]
    if width >= views.JOBS_WORKER_AT:
        headers[6:6] = ["worker"]
    assert lines[1].split() == headers
    assert len(lines) == 3 + len(page.jobs) + 1
    assert lines[-1] == f"more jobs: --after {page.next_cursor}"
    shown = views.short_ids(job.job_id for job in page.jobs)
    for job in page.jobs:
        line = row(lines[:-1], shown[job.job_id] + " ")
        assert f" {job.state} " in line and f" {job.attempt}/{job.max_attempts} " in line
        at = views.format_minute(views.job_time(job))
        assert (at if width >= views.JOBS_YEAR_AT else at[5:]) in line
        if job.last_error:  # its first 19 characters at least, 30 from 120 columns
            assert job.last_error.splitlines()[0][: 19 if width < 120 else 24] in line, line
        if job.worker_id and width >= views.JOBS_WORKER_AT:
            assert job.worker_id[:6] in line, line
    # A queue of 40 characters is whole at 200 columns; at 120 beside the worker, cut in
    # the middle, its start and end kept.
    assert (QUEUE_40 in "\n".join(lines)) == (width >= 200)
    assert QUEUE_40[:5] in row(lines, "ready") and QUEUE_40[-4:] in row(lines, " ready ")


def test_jobs_table_times_follow_the_state_and_says_when_empty():
    page = jobs_page()
    pending, ready, leased, retrying, succeeded, *_ = page.jobs
    assert views.job_time(pending) == pending.run_at
    assert views.job_time(ready) == ready.ready_at
    assert views.job_time(leased) == leased.lease_expires_at
    assert views.job_time(retrying) == retrying.run_at
    assert views.job_time(succeeded) == succeeded.finished_at
    lines = lines_of(views.jobs_table(JobsPage([], None)), 80)
    assert "no jobs" in row(lines, "no jobs")


# -- one job ------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [80, 100, 200])
def test_job_panel_shows_fields_timings_errors_payload_and_result(width):
    job = dead_job(
        state=JobState.SUCCEEDED, priority="critical", attempt=3, max_attempts=4,
        ready_at=T0 + 2_800, idempotency_key="order-7", result={"charged": 1250},
        errors=[ErrorEntry(1, "DemoFailure: card declined", T0 + 1_000),
                ErrorEntry(2, "DemoFailure: gateway timeout", T0 + 2_500)],
        last_error="DemoFailure: gateway timeout", finished_at=T0 + 3_100,
    )  # fmt: skip
    text = "\n".join(lines_of(views.job_panel(job), width))
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


@pytest.mark.parametrize("width", WIDTHS)
def test_job_panel_history_is_a_line_per_attempt_and_the_values_are_whole(width):
    error = ERRORS["timeout"]
    job = dead_job(job_id(T0, 3), QUEUE_40, error, attempt=3, max_attempts=3, errors=[
        ErrorEntry(n, error, T0 + n * 1_000) for n in (1, 2, 3)
    ])  # fmt: skip
    lines = lines_of(views.job_panel(job), width)
    assert job.job_id in lines[0]  # the whole id, in the title
    assert QUEUE_40 in row(lines, " queue ")
    history = [line for line in lines if "TimeoutError" in line and "attempt" not in line]
    for n in (1, 2, 3):
        line = row(lines, f"2026-01-01 00:00:0{n}.000 ")
        assert line.split()[1:3] == [str(n), "2026-01-01"]
        assert error[:25] in line and "Traceback" not in line
    # The last error is whole above the history, on as many lines as it takes.
    text = "\n".join(lines)
    assert "Traceback (most recent call last):" in text and "File x.py" in text
    assert len(history) == 3 + 1  # three attempts, and the first line of the last error


@pytest.mark.parametrize("width", WIDTHS)
def test_job_panel_folds_a_long_payload_and_result_rather_than_cutting_them(width):
    long = "warehouse query took over 30 s while closing the month of " + "x" * 150
    job = dead_job(payload={"error": long, "n": 1}, result={"note": long[::-1]})
    lines = lines_of(views.job_panel(job), width)
    assert all(len(line) <= width for line in lines)
    text = "".join("".join(line.strip("│ ").split()) for line in lines)
    assert "".join(long.split()) in text and "".join(long[::-1].split()) in text


@pytest.mark.parametrize("width", WIDTHS)
def test_job_panel_shows_the_latest_traceback_whole_and_folded(width):
    frames = "".join(
        f'  File "/srv/app/jobs/billing.py", line {n}, in step_{n}\n' for n in range(9)
    )
    traceback = f"Traceback (most recent call last):\n{frames}TimeoutError: warehouse timed out"
    job = dead_job(attempt=2, max_attempts=2, errors=[
        ErrorEntry(1, "TimeoutError: first", T0 + 1_000, "Traceback: the first attempt's"),
        ErrorEntry(2, "TimeoutError: warehouse timed out", T0 + 2_000, traceback),
    ])  # fmt: skip
    lines = lines_of(views.job_panel(job), width)
    assert all(len(line) <= width for line in lines)
    text = "".join(line.strip("│ ") for line in lines)
    assert "traceback of attempt 2" in text and "the first attempt's" not in text
    assert "".join(traceback.split()) in "".join(text.split())  # whole, if folded
    without = dead_job(errors=[ErrorEntry(1, "lease expired", T0 + 1_000)])
    assert "traceback of" not in render(views.job_panel(without))


def attempts_job(**fields) -> JobView:
    """A job that succeeded on its fourth attempt, after a failure, an expiry, a timeout
    and a release; three older attempts no longer kept."""
    error = ERRORS["timeout"]
    out = AttemptOutcome
    attempts = [
        AttemptEntry(1, out.FAILED, T0 + 10, T0 + 1_000, "host-a.example.com:1234:abcdef",
                     error, "Traceback: the first attempt's\n" + error),
        AttemptEntry(2, out.EXPIRED, T0 + 2_000, T0 + 32_000, "host-b:99:x", "lease expired"),
        AttemptEntry(3, out.TIMED_OUT, T0 + 40_000, T0 + 52_000, "w3",
                     "timed out after 10000 ms"),
        AttemptEntry(4, out.RELEASED, T0 + 60_000, T0 + 60_100, "w4"),
        AttemptEntry(4, out.SUCCEEDED, T0 + 61_000, T0 + 3_800_000, "w5"),
    ]  # fmt: skip
    return dead_job(
        state=JobState.SUCCEEDED, attempt=4, max_attempts=5, attempts=attempts,
        attempts_dropped=3, finished_at=T0 + 3_800_000, errors=[
            ErrorEntry(1, error, T0 + 1_000, attempts[0].traceback),
            ErrorEntry(2, "lease expired", T0 + 32_000),
            ErrorEntry(3, "timed out after 10000 ms", T0 + 52_000),
        ], **fields,
    )  # fmt: skip


@pytest.mark.parametrize("width", [80, 120, 200])
def test_job_panel_shows_the_attempts_as_a_timeline_a_line_each(width):
    job = attempts_job()
    lines = lines_of(views.job_panel(job), width)
    text = "\n".join(lines)
    assert "attempts (3 older ones not kept)" in text
    header = row(lines, " start (UTC) ")
    for name in ("#", "took", "worker", "outcome", "error"):
        assert f" {name} " in header + " ", name
    wide = width >= 120
    expected = [  # number, start, took, outcome, and a start of the error
        ("1", "00:00:00", "990 ms", "failed", "TimeoutError"),
        ("2", "00:00:02", "30.0 s", "expired", "lease expired"),
        ("3", "00:00:40", "12.0 s", "timed out", "timed out after"),
        ("4", "00:01:00", "100 ms", "released", ""),
        ("4", "00:01:01", "1h 02m 19s", "succeeded", ""),
    ]
    for number, start, took, outcome, error in expected:
        line = row(lines, f" {took} ")
        assert line.split()[1] == number and start in line and f" {outcome}" in line
        assert error in line
        # Wide, the start is a whole time to the millisecond; narrow, without the year.
        assert ("2026-01-01 " + start + "." in line) == wide
        assert ("01-01 " + start in line) is True
    # A worker id is shown as it is (no emoji codes), whole where it fits.
    first = row(lines, " 990 ms ")
    assert ("host-a.example.com:1234:abcdef" in first) == wide
    assert "host-a.exam" in first and "🔢" not in first
    # The traceback of the latest attempt that sent one, below the timeline.
    assert "traceback of attempt 1" in text
    # No separate error history: the timeline holds it.
    assert "at (UTC)" not in text


def test_job_panel_attempts_of_an_old_record_and_a_running_one_say_what_is_unknown():
    job = dead_job(state=JobState.LEASED, attempt=2, attempts=[
        AttemptEntry(1, AttemptOutcome.INTERRUPTED, None, T0 + 5_000, None, "lease lost"),
        AttemptEntry(2, AttemptOutcome.RUNNING, T0 + 6_000, None, "w1"),
    ])  # fmt: skip
    lines = lines_of(views.job_panel(job), 80)
    old, running = row(lines, " interrupted "), row(lines, " running ")
    assert old.split()[1:4] == ["1", "-", "-"]  # no start, so no duration, no worker
    assert running.split()[1] == "2" and "01-01 00:00:06" in running and " w1 " in running


def test_job_panel_of_a_fresh_job_leaves_out_what_it_does_not_have():
    job = JobView(job_id=JOB, queue="email", state=JobState.READY, priority="normal",
                  payload=[1, "two"], attempt=0, max_attempts=4, created_at=T0)  # fmt: skip
    text = render(views.job_panel(job))
    assert "ready" in text and "0 of 4" in text and '"two"' in text
    for absent in ("errors", "result", "last error", "worker", "finished", "lease expires"):
        assert absent not in text, absent


def test_job_panel_folds_a_queue_of_128_characters_rather_than_cutting_it():
    job = dead_job(queue=QUEUE_128)
    text = "".join(line.strip("│ ") for line in lines_of(views.job_panel(job), 80))
    assert QUEUE_128 in text


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


@pytest.mark.parametrize("width", [80, 120])
def test_the_demos_progress_and_tables_read_at_80_and_120_columns(width):
    """What ``relay-trio demo`` prints at its end (cli/work.py): its progress bars, the
    stats and its dead jobs (one batch: ids of one millisecond)."""
    s = stats(email=counts(succeeded=9_995), thumbnails=counts(succeeded=2_000),
              reports=counts(succeeded=2_000), payments=counts(succeeded=1_400, dead=400),
              webhooks=counts(dead=350))  # fmt: skip
    console = Console(file=io.StringIO(), width=width, color_system=None)
    progress, tasks = views.state_progress(console)
    views.update_state_progress(progress, tasks, s)
    errors = ["DemoFailure: endpoint answered 410 Gone", "DemoFailure: insufficient funds"]
    dead = DeadPage([
        dead_job(job_id(T0, n), "webhooks" if n % 2 else "payments", errors[n % 2])
        for n in range(1, 21)
    ], None)  # fmt: skip
    lines = [
        *lines_of(progress.make_tasks_table(progress.tasks), width),
        *lines_of(views.stats_table(s), width),
        *lines_of(views.dead_table(dead), width),
    ]
    assert row(lines, "succeeded ━").endswith("15395/16145")
    # Ids of one batch made in a row differ only in their last digit: each is shown whole,
    # which leaves the errors 23 characters at 80 columns, and whole at 120.
    assert views.short_ids(job.job_id for job in dead.jobs) == {
        j.job_id: j.job_id for j in dead.jobs
    }
    for job in dead.jobs:
        assert job.last_error[: 22 if width == 80 else 39] in row(lines, job.job_id)


# -- through the commands -----------------------------------------------------------------


def test_the_demo_reads_at_80_columns_through_the_command():
    """``COLUMNS=80 relay-trio demo | cat``: a line per dead job, with the first words of
    its error; no line ends in spaces, and the tables' lines fit 80 columns (the
    paragraphs are one line each: whatever reads a pipe wraps them)."""
    env = cli_env()
    env["COLUMNS"] = "80"
    done = subprocess.run([str(RELAY), "demo", "--seed", "1"], env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done
    lines = done.stdout.splitlines()
    for line in lines:
        assert line == line.rstrip(), f"spaces at the end of {line!r}"
    assert lines[0].startswith("relay-trio demo: 60 jobs") and lines[0].endswith("slots.")
    tables = lines[next(n for n, line in enumerate(lines) if line.strip() == "Queues") :]
    tables = tables[: next(n for n, line in enumerate(tables) if line.startswith("Done in"))]
    for line in tables:
        assert len(line) <= 80, line
    rows = [line for line in tables if line.startswith("job_")]
    assert len(rows) == 8  # 4 doomed and 4 rejected of the 60 jobs
    for line in rows:
        # The ids of one batch are 19 or 20 characters (short_ids): the error keeps 23,
        # "DemoFailure: " and its first word ("endpoint", "upstream", "insuffic...").
        assert "DemoFailure: " in line and len(line.split("DemoFailure: ")[1]) >= 9, line


async def test_stats_and_dead_list_read_at_80_columns_through_the_commands(address, client):
    """A 43-character queue name does not push ``relay-trio stats`` onto several lines a
    queue, and ``relay-trio dead list`` shows the first words of each error."""
    long_queue = "billing.invoice-reminders.nightly-run-eu-01"
    for queue in (long_queue, "email"):
        await client.submit(queue, {"n": 1})
        (job,) = await client.lease([queue], "w")
        await client.fail(job.job_id, "w", job.token, ERRORS["timeout"], retryable=False)
        await client.submit(queue, {"n": 2})  # one ready as well
    env = cli_env(address)
    env["COLUMNS"] = "80"
    for args in (["stats"], ["dead", "list"]):
        result = await relay_trio(*args, env=env)
        assert result.code == 0, result
        lines = result.stdout.splitlines()
        for line in lines:
            assert len(line) <= 80 and line == line.rstrip(), line
        for start in ("billin", "email"):
            assert len([line for line in lines if start in line]) == 1, (start, lines)
    for line in lines[3:5]:  # the dead jobs' rows, under the title and the headers
        # Ids made in one millisecond with another job's are whole (unique among all the
        # jobs): the error keeps 19 characters at least.
        assert "TimeoutError: ware" in line, lines


# -- history ------------------------------------------------------------------------------


def history_of(n: int, step: int = 60_000) -> History:
    points = [
        HistoryPoint(
            T0 + i * step,
            submitted=10 * i,
            succeeded=8 * i,
            failed=i % 3,
            dead=int(i % 5 == 4),
            run_count=8 * i,
            run_sum_ms=8 * i * 250,
            run_max_ms=1_000 + i,
            wait_count=8 * i,
            wait_sum_ms=8 * i * 40,
            wait_max_ms=65_000 if i == 7 else 90,
        )
        for i in range(n)
    ]
    return History("email", T0, T0 + n * step, step, points)


@pytest.mark.parametrize("width", WIDTHS)
def test_history_table_shows_a_row_per_step_totals_bars_and_sparklines(width):
    lines = lines_of(views.history_table(history_of(12)), width)
    assert lines[0] == "email · 2026-01-01 00:00 to 00:12 UTC · per 1m"
    first = next(line for line in lines if line.startswith("00:00 "))
    busiest = row(lines, "00:11 ")
    assert first.split()[1:] == ["0", "0", "0", "0", "-", "-", "-", "-"]  # nothing timed
    assert busiest.split()[1:5] == ["110", "88", "2", "0"]
    assert "250 ms" in busiest and "1.0 s" in busiest
    assert "1m 05s" in row(lines, "00:07 ")  # the longest wait, in its step
    total = row(lines, "total").split()
    assert total[1:5] == [str(10 * 66), str(8 * 66), "12", "2"]
    # The bar: the busiest step's is the widest (succeeded █, failed ▒); none where nothing.
    assert "█" in busiest and "▒" in busiest and "█" not in first
    assert busiest.count("█") + busiest.count("▒") >= row(lines, "00:03 ").count("█")
    sparks = row(lines, "succeeded ·")
    assert len(sparks.split()[1]) == 12 and sparks.endswith("█")


def test_history_table_leaves_the_sparklines_out_where_the_steps_do_not_fit():
    lines = lines_of(views.history_table(history_of(100)), 80)
    assert not any("succeeded ·" in line for line in lines)
    assert "succeeded ·" in "\n".join(lines_of(views.history_table(history_of(100)), 120))


def test_history_table_of_days_shows_dates():
    lines = lines_of(views.history_table(history_of(30, step=3_600_000)), 80)
    assert lines[0] == "email · 2026-01-01 00:00 to 2026-01-02 06:00 UTC · per 1h"
    assert row(lines, "01-02 05:00").split()[2] == "290"
