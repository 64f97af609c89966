"""Data in, rich renderables out: the tables, panels and progress bars of the command line.

Pure functions over the client's typed results (``Stats``, ``DeadPage``, ``JobView``): no
I/O and no clock reads, so each view is tested by rendering it into
``Console(file=io.StringIO(), width=80)`` and wider. Times are shown in UTC (the job panel
gives their raw milliseconds too, so what the terminal shows can be matched with what
``--json`` prints).

Every table is laid out for the width it is drawn at (``Fitted``): one line per row, its
numbers, ids, times and headers whole, and the room that is left given to the queue names
and the errors, which are cut only when that room runs out: a queue name in the middle
(``cut_middle``), an error at its end, after its first ``ERROR_MIN`` characters at least.
A job id is shown abbreviated as git abbreviates a hash: as the server abbreviates it,
unique among all its jobs at the time it is shown (``short``: whole id -> shown id, which
the commands ask for, cli/ids.py), else as the shortest abbreviation unique among the rows
(``short_ids``, for a server without ``short_ids``). The commands take it back. Whole with
``full_ids=True`` (``--json`` always has whole ids). No line ends in spaces: rich pads
every cell to its column's width, which a terminal hides but a pipe keeps.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.json import JSON
from rich.measure import Measurement
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

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
    ScheduleInfo,
    SchedulePage,
    Stats,
    WorkerInfo,
    WorkersPage,
)
from relay.protocol.cron import zone
from relay.protocol.model import (
    AttemptEntry,
    JobState,
    format_job_id,
    job_id_abbreviation,
    parse_job_id,
)
from relay.util.printable import printable

STATES: tuple[str, ...] = tuple(str(state) for state in JobState)
UNFINISHED: tuple[str, ...] = tuple(str(s) for s in JobState if not s.terminal)
# States whose column a table shows only while some queue has jobs in them: cancelling is
# rare, and the room is the queue names'. (``--json`` always has every state.)
SHOWN_IF_ANY: tuple[str, ...] = ("cancelled",)


def shown_states(totals: Mapping[str, int]) -> list[str]:
    """The states whose columns a table shows, given the jobs per state (``totals``)."""
    return [state for state in STATES if state not in SHOWN_IF_ANY or totals.get(state)]


STATE_STYLES: Mapping[str, str] = {
    "pending": "cyan",
    "ready": "blue",
    "leased": "yellow",
    "retrying": "magenta",
    "succeeded": "green",
    "dead": "red",
    "cancelled": "dim",
}
PRIORITY_STYLES: Mapping[str, str] = {
    "low": "dim",
    "normal": "",
    "high": "bold",
    "critical": "bold red",
}

ELLIPSIS = "…"
# Before a queue name is cut, an error keeps this many characters of its first line: enough
# for its type and first words ("DemoFailure: card declined", "TimeoutError: warehouse").
ERROR_MIN = 25
# A queue name (up to 128 characters) is cut no shorter than this, so that both its ends
# stay identifiable: "billin…batch" for "billing.invoices.nightly-batch".
QUEUE_MIN = 12
# A queue name of up to this many characters (most are) is shown whole before an error
# gets more than its ERROR_MIN characters; a longer one only once the errors are whole.
QUEUE_WHOLE = 40
# Columns between two cells of a table: one of padding and the box's blank separator; in
# the tables of counts, the separator alone, so that a queue's name has more room.
GAP = 2
NUMBERS_GAP = 1


# -- values -------------------------------------------------------------------------------


def format_time(ms: int | None, *, millis: bool = True) -> str:
    """Milliseconds since the epoch as a UTC time, "-" for None."""
    if ms is None:
        return "-"
    when = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    text = when.strftime("%Y-%m-%d %H:%M:%S")
    if millis:
        text += f".{ms % 1000:03d}"
    return text + " UTC"


def format_minute(ms: int | None) -> str:
    """Milliseconds since the epoch as a UTC time to the minute ("2026-01-01 00:00"), "-"
    for None: a table's column, whose header says UTC."""
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M")


def format_duration(ms: int) -> str:
    """A duration for people: "350 ms", "4.2 s", "2m 03s", "1h 02m 03s", "3d 04h 05m"."""
    if ms < 1000:
        return f"{ms} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    seconds = ms // 1000
    days, seconds = divmod(seconds, 86_400)
    hours, seconds = divmod(seconds, 3_600)
    minutes, seconds = divmod(seconds, 60)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {seconds:02d}s"
    return f"{minutes}m {seconds:02d}s"


def short_duration(ms: int) -> str:
    """``format_duration`` in two units at most ("1h 02m", "3d 04h"): six characters at
    most, a table's column."""
    if ms < 3_600_000:
        return format_duration(ms)
    return format_duration(ms).rsplit(" ", 1)[0]


def truncate(text: str | None, limit: int | None = None) -> str:
    """The first line of ``text`` (``printable``), at most ``limit`` cells wide; it ends in
    "…" if it was cut or if more lines follow."""
    if not text:
        return ""
    lines = printable(text.strip()).splitlines()
    line = Text(lines[0] if lines else "")
    if len(lines) > 1:
        line.append(ELLIPSIS)
    if limit is not None and line.cell_len > limit:
        line.truncate(limit, overflow="ellipsis")
    return line.plain


def cut_middle(name: str, width: int) -> str:
    """``name`` if it fits in ``width`` cells, else its start and end with "…" between:
    "billing.invoi…nightly-batch". A queue name is cut so (they are ASCII): its start
    usually names the family, its end tells it from its siblings."""
    if len(name) <= width:
        return name
    if width < 3:
        return name[:width]
    tail = (width - 1) // 2
    return name[: width - 1 - tail] + ELLIPSIS + name[len(name) - tail :]


def state_text(state: str) -> Text:
    return Text(str(state), style=STATE_STYLES.get(str(state), ""))


def priority_text(priority: str) -> Text:
    return Text(priority, style=PRIORITY_STYLES.get(priority, ""))


def totals_by_state(stats: Stats) -> dict[str, int]:
    """Jobs per state over every queue (every state present, zeros included)."""
    return sum_counts(stats.queues.values())


def sum_counts(many: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Jobs per state summed over ``many`` queues' counts (every state present)."""
    totals = dict.fromkeys(STATES, 0)
    for counts in many:
        for state, count in counts.items():
            totals[state] = totals.get(state, 0) + count
    return totals


def unfinished(stats: Stats) -> int:
    """Jobs that have not finished (pending, ready, leased, retrying)."""
    totals = totals_by_state(stats)
    return sum(totals[state] for state in UNFINISHED)


# -- job ids ------------------------------------------------------------------------------


def short_ids(ids: Iterable[str], short: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each job id in ``ids`` -> the id shown for it: as ``short`` gives it (the server's
    abbreviations, unique among all its jobs: ``relay-trio inspect`` and ``dead
    retry``/``purge`` take them back), else shortened among ``ids`` alone, the fallback
    for a server without ``short_ids``: "job_" and the fewest of its hex digits,
    ID_ABBREV_MIN (7) at least, that no other of ``ids`` begins with ("job_34472c7",
    "job_34472d0a"), by the rule the server applies to all its jobs
    (``model.job_id_abbreviation``). An id's first digits are its creation time
    (relay/protocol/model.py): ids made seconds apart differ within their first 7 to 9 digits, ids
    of different milliseconds within 11, and ids made in one millisecond (a batch) only
    in their sequence number's digits: those keep 12 to 16 digits (15 or 16 in a batch of
    a few hundred), up to the whole id. Shortened among the rows only, an id may be the
    start of other jobs' ids too (those made within ~33 s of it): typed back, it is then
    refused as ambiguous. A string that is not a job id stays whole."""
    ids = list(ids)
    keys = sorted({key for key in map(parse_job_id, ids) if key is not None})
    # Sorted, an id shares the most digits with its neighbours.
    shown = {
        format_job_id(key): job_id_abbreviation(key, keys[max(0, i - 1) : i] + keys[i + 1 : i + 2])
        for i, key in enumerate(keys)
    }
    if short is not None:
        shown.update((job_id, short[job_id]) for job_id in ids if job_id in short)
    return {job_id: shown.get(job_id, job_id) for job_id in ids}


# -- laying a table out -------------------------------------------------------------------


class Fitted:
    """A view laid out for the width it is drawn at, with no spaces at its lines' ends.

    ``layout(width)`` makes the renderable, so that a table can give the room it has to
    the columns that need it. Rich pads each cell to its column's width and a title to the
    table's: a terminal does not show those spaces, but a file or a pipe keeps them, so
    they are cut from every line drawn.
    """

    def __init__(self, layout: Callable[[int], RenderableType]) -> None:
        self.layout = layout

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # Without a height (a full-screen Live gives one, which render_lines pads up to), and
        # wrapping as a table's cells do also on a console that soft-wraps its prints.
        options = options.update(height=None, no_wrap=False, overflow=None)
        for line in console.render_lines(self.layout(options.max_width), options, pad=False):
            yield from _rstrip(line)
            yield Segment.line()

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.layout(options.max_width))


def _rstrip(line: list[Segment]) -> list[Segment]:
    """``line`` without the spaces at its end."""
    end = len(line)
    while end and not line[end - 1].control and not line[end - 1].text.rstrip(" "):
        end -= 1
    if not end or line[end - 1].control:
        return line[:end]
    text, style, control = line[end - 1]
    return [*line[: end - 1], Segment(text.rstrip(" "), style, control)]


def plain_table(title: str | None = None, *, gap: int = GAP) -> Table:
    """The look of every table here: a rule under the headers, no borders, ``gap`` (1 or
    2) columns between cells; one line per row."""
    return Table(
        title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
        collapse_padding=True, padding=(0, gap - 1),
    )  # fmt: skip


def column_width(header: str, cells: Iterable[str | Text]) -> int:
    """The cells a column needs for ``header`` (one line of it per "\n") and ``cells``."""
    widths = [cell_len(line) for line in header.split("\n")]
    widths += [cell.cell_len if isinstance(cell, Text) else cell_len(cell) for cell in cells]
    return max(widths)


def queue_width(names: Iterable[str], room: int) -> int:
    """The width of a queue column that has ``room``: its longest name if that fits, else
    what is left (QUEUE_MIN at least; names are then cut in the middle)."""
    longest = max((len(name) for name in names), default=0)
    return max(min(longest, QUEUE_MIN), min(longest, room))


def share_room(room: int, queues: Iterable[str], errors: Sequence[str]) -> tuple[int, int]:
    """Widths of a queue column and an error column that share ``room``, given in this
    order: QUEUE_MIN to the queue names; the errors' first ERROR_MIN characters; the names
    up to QUEUE_WHOLE; the errors as far as their first lines go; the longer names."""
    names = list(queues)
    longest_error = max((cell_len(error) for error in errors), default=0)
    # Less than ERROR_MIN where the other columns leave less (ids of one millisecond, or
    # whole ids, at 80 columns).
    error = max(0, min(longest_error, ERROR_MIN, room - queue_width(names, QUEUE_MIN)))
    queue = queue_width([name[:QUEUE_WHOLE] for name in names], room - error)
    error = max(error, min(longest_error, room - queue))
    return queue_width(names, room - error), error


def tables_width(widths: Sequence[int], gap: int = GAP) -> int:
    """The width of a ``plain_table`` with columns of these widths."""
    return sum(widths) + gap * (len(widths) - 1)


def queues_table(queue: int, headers: Sequence[str], widths: Sequence[int]) -> Table:
    """The "Queues" table of ``stats`` and ``queue list``: a queue column ``queue`` wide,
    then a right-aligned column per header (a state's in its colour, the total bold)."""
    table = plain_table("Queues", gap=NUMBERS_GAP)
    table.add_column("queue", width=queue, no_wrap=True)
    for header, column in zip(headers, widths, strict=True):
        table.add_column(
            header, justify="right", width=column, no_wrap=True,
            header_style=STATE_STYLES.get(header, ""), style="bold" if header == "total" else "",
        )  # fmt: skip
    return table


# -- stats --------------------------------------------------------------------------------


def short_number(n: int) -> str:
    """``n`` as it is below a million; above, truncated to three figures with M, G or T
    ("1.23M", "12.3M", "123M"): a count column stays within six characters, so the stats
    table fits 80 columns whatever the counts."""
    for suffix, size in (("T", 10**12), ("G", 10**9), ("M", 10**6)):
        if n >= size:
            whole = n // size
            decimals = 2 if whole < 10 else 1 if whole < 100 else 0
            digits = str(n * 10**decimals // size)
            if decimals:
                digits = f"{digits[:-decimals]}.{digits[-decimals:]}"
            return digits + suffix
    return str(n)


# After a paused queue's name, in the tables of queues (stats, top); after a queue's with
# a limit (max_leased or rate: ``queue set``), LIMITED_MARK.
PAUSED_MARK = " paused"
LIMITED_MARK = " limited"
PAUSED_STYLE = "bold yellow"
LIMITED_STYLE = "cyan"


def queue_cell(name: str, paused: bool, width: int, limited: bool = False) -> Text:
    """A queue's cell in a column ``width`` wide: its name (cut in the middle if need be),
    and PAUSED_MARK after it if it is paused, LIMITED_MARK if it has a limit. The name goes
    first: without room for it and its marks, it is shown in the colour of its first mark
    and ``paused_caption`` names it."""
    if not (paused or limited):
        return Text(cut_middle(name, width))
    if len(marked(name, paused, limited)) > width:
        return Text(cut_middle(name, width), style=PAUSED_STYLE if paused else LIMITED_STYLE)
    text = Text(name)
    if paused:
        text.append(PAUSED_MARK, style=PAUSED_STYLE)
    if limited:
        text.append(LIMITED_MARK, style=LIMITED_STYLE)
    return text


def paused_caption(paused: Sequence[str], width: int, limited: Sequence[str] = ()) -> Text | None:
    """Under a table of queues: the paused ones, and those with a limit, whose cells
    (``width`` wide) had no room for their marks (``queue_cell``), by name, a few of each at
    most; None if there are none."""
    is_paused, is_limited = set(paused), set(limited)
    parts = []
    for names, label in ((paused, "paused (yellow)"), (limited, "limited (cyan)")):
        unmarked = [name for name in names if len(marked(name, name in is_paused,
                                                         name in is_limited)) > width]  # fmt: skip
        if label.startswith("limited"):  # (a paused one is in yellow: named as paused)
            unmarked = [name for name in unmarked if name not in is_paused]
        if unmarked:
            more = f" and {len(unmarked) - 3} more" if len(unmarked) > 3 else ""
            parts.append(f"{label}: {', '.join(unmarked[:3])}{more}")
    if not parts:
        return None
    return Text(" · ".join(parts), style="table.caption")


def marked(name: str, paused: bool, limited: bool = False) -> str:
    """A queue's name as its cell shows it whole: for the width of the queue column."""
    return name + (PAUSED_MARK if paused else "") + (LIMITED_MARK if limited else "")


def count_text(count: int, state: str | None = None) -> Text:
    if count == 0:
        return Text("0", style="dim")
    return Text(short_number(count), style=STATE_STYLES.get(state or "", ""))


OLDEST_READY = "oldest\nready"  # how long a queue's oldest ready job has waited


def stats_table(stats: Stats, limited: Iterable[str] = ()) -> Fitted:
    """Queues (rows, sorted by name) by states (columns), a total per queue, how long its
    oldest ready job has waited, and a totals row; the server's version, uptime and
    connections below.

    The cancelled column is shown only while some queue has cancelled jobs
    (``SHOWN_IF_ANY``). The eight columns of numbers take 59 to 63 cells (a count is six
    at most), so at 80 columns a queue name of 17 to 21 characters is whole (at 100, 37 to
    41; at 120, 57 to 61); a longer one is cut in the middle (``cut_middle``), to
    QUEUE_MIN at the least.

    A paused queue's name is marked so (``queue_cell``), and one in ``limited`` (it has a
    max_leased or a rate: a stats reply does not say, ``relay-trio stats`` asks
    ``queue_list`` for the page's queues) too; where the marks would cut the name, the name
    is coloured and a line under the table names it (``paused_caption``).
    """
    return Fitted(functools.partial(_stats_layout, stats, frozenset(limited)))


def _stats_layout(stats: Stats, limited: frozenset[str], width: int) -> RenderableType:
    server = stats.server
    connections = f"{server.connections} connection" + ("" if server.connections == 1 else "s")
    uptime = format_duration(server.uptime_ms)
    caption = f"relay-trio {server.version} · up {uptime} · {connections}"
    oldest = stats.oldest_ready_ms or {}
    names = sorted(stats.queues)
    paused = set(stats.paused)
    totals = totals_by_state(stats)
    states = shown_states(totals)
    rows = []
    for name in names:
        counts = stats.queues[name]
        wait = oldest.get(name)
        rows.append([
            *(count_text(counts.get(state, 0), state) for state in states),
            Text(short_number(sum(counts.get(state, 0) for state in STATES))),
            Text("-" if wait is None else short_duration(wait)),
        ])  # fmt: skip
    total_row = [*(count_text(totals[state], state) for state in states),
                 Text(short_number(sum(totals.values()))), Text("")]  # fmt: skip
    headers = [*states, "total", OLDEST_READY]
    widths = [column_width(header, [row[i] for row in [*rows, total_row]])
              for i, header in enumerate(headers)]  # fmt: skip
    widths[-1] += 1  # "1d 02h" has a space: one more before it, so it reads as one value
    labels = (
        [*(marked(n, n in paused, n in limited) for n in names), "queue", "total"]
        if names
        else ["no jobs yet"]
    )
    queue = queue_width(labels, width - tables_width([0, *widths], NUMBERS_GAP))

    table = queues_table(queue, headers, widths)
    for name, row in zip(names, rows, strict=True):
        table.add_row(queue_cell(name, name in paused, queue, name in limited), *row)
    if not names:
        table.add_row(Text("no jobs yet", style="dim"), *("" for _ in headers))
    table.add_section()
    table.add_row(Text("total", style="bold"), *total_row, style="bold")
    notes = [Text(caption, style="table.caption")]
    unmarked = paused_caption([name for name in names if name in paused], queue,
                              [name for name in names if name in limited])  # fmt: skip
    if unmarked is not None:
        notes.append(unmarked)
    if stats.next_cursor is not None and stats.total_queues is not None:
        # (the server answers a page of queues by name: the total is of those shown)
        notes.append(Text(
            f"the first {len(names)} of {stats.total_queues} queues; --queue NAME for others",
            style="table.caption",
        ))  # fmt: skip
    return Group(table, *notes)


# -- dead jobs ----------------------------------------------------------------------------


def failed_at(job: JobView) -> int | None:
    """When the job went dead: its finish time, else the time of its last error."""
    if job.finished_at is not None:
        return job.finished_at
    return job.errors[-1].at if job.errors else None


def queue_table(page: QueuePage) -> Fitted:
    """``relay-trio queue list``: one row per queue (those with jobs or settings, by
    name), whether it is paused, its limits and defaults (``limits_text``,
    ``defaults_text``; each column only while a queue of the page has some), its jobs in
    each state and their total; below it, the option that gives the next page, if there is
    one. The cancelled column is shown only while a queue of the page has cancelled jobs
    (``SHOWN_IF_ANY``), as in ``stats``.

    The numbers take about as much room as the stats table's (a count is six cells at
    most, "paused" six): without settings, at 80 columns a queue name of about 20
    characters is whole, at 120 about 60; a longer one is cut in the middle
    (``cut_middle``), to QUEUE_MIN at the least. The settings' columns come out of the
    queue names' room while it keeps SETTINGS_ROOM (or the longest name, if shorter):
    where it would not, the defaults' column goes first, then the limits', and a line
    under the table says where to see them (``queue show``)."""
    return Fitted(functools.partial(_queue_layout, page))


# The queue names' room (or the longest name's, if shorter) that the settings' columns of
# ``queue list`` leave at least: at 80 columns, a page with limits keeps its limits column
# and names of 20 characters whole.
SETTINGS_ROOM = 20


def _queue_layout(page: QueuePage, width: int) -> RenderableType:
    queues = page.queues
    states = shown_states(sum_counts(info.counts for info in queues))  # (cancelled: if any)
    settings: dict[str, list[Text]] = {}
    for header, shown in (("limits", limits_text), ("defaults", defaults_text)):
        cells = [shown(info) for info in queues]
        if any(cells):
            settings[header] = [cell or Text("-", style="dim") for cell in cells]
    rows = []
    for info in queues:
        counts = info.counts
        rows.append([
            Text("paused", style="bold yellow") if info.paused else Text("-", style="dim"),
            *(count_text(counts.get(state, 0), state) for state in states),
            Text(short_number(sum(counts.get(state, 0) for state in STATES))),
        ])  # fmt: skip
    headers = ["paused", *states, "total"]
    widths = [column_width(header, [row[i] for row in rows]) for i, header in enumerate(headers)]
    labels = [info.queue for info in queues] + ["queue"] if queues else ["no queues yet"]
    wanted = min(max(map(len, labels)), SETTINGS_ROOM)
    hidden = []
    for header in ("defaults", "limits"):
        shown = [column_width(h, cells) for h, cells in settings.items()]
        if header in settings and width - tables_width([0, *widths, *shown], NUMBERS_GAP) < wanted:
            del settings[header]
            hidden.insert(0, header)
    shown = [column_width(h, cells) for h, cells in settings.items()]
    queue = queue_width(labels, width - tables_width([0, *widths, *shown], NUMBERS_GAP))

    table = plain_table("Queues", gap=NUMBERS_GAP)
    table.add_column("queue", width=queue, no_wrap=True)
    table.add_column("paused", width=widths[0], no_wrap=True, justify="right")
    for header, column in zip(settings, shown, strict=True):
        table.add_column(header, width=column, no_wrap=True)
    for header, column in zip(headers[1:], widths[1:], strict=True):
        table.add_column(
            header, justify="right", width=column, no_wrap=True,
            header_style=STATE_STYLES.get(header, ""), style="bold" if header == "total" else "",
        )  # fmt: skip
    for n, (info, row) in enumerate(zip(queues, rows, strict=True)):
        table.add_row(cut_middle(info.queue, queue), row[0],
                      *(cells[n] for cells in settings.values()), *row[1:])  # fmt: skip
    if not queues:
        table.add_row(Text("no queues yet", style="dim"), *("" for _ in [*headers, *settings]))
    notes: list[RenderableType] = [table]
    if hidden:
        notes.append(Text(f"{' and '.join(hidden)}: relay-trio queue show NAME (or wider)",
                          style="table.caption"))  # fmt: skip
    if page.next_cursor is not None:
        notes.append(Text(f"next page: --cursor {page.next_cursor}", style="table.caption"))
    return notes[0] if len(notes) == 1 else Group(*notes)


# -- a queue's settings -------------------------------------------------------------------


def compact_duration(ms: int) -> str:
    """A duration as ``relay-trio queue set`` takes it: in the largest unit it is a whole
    number of ("90s", "5m", "1500ms", "2h", "1d")."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def rate_text(rate: Mapping[str, int]) -> str:
    """A rate as ``--rate`` takes it: "100/s", "10/m", "5/500ms", "100/90s"."""
    period = compact_duration(rate["period_ms"])
    return f"{rate['limit']}/{period.removeprefix('1') if period[1:2].isalpha() else period}"


def backoff_text(backoff: Mapping[str, Any]) -> str:
    """A backoff as ``--default-backoff`` (and ``submit --backoff``) takes it: "fixed:10s",
    "exp:1s:5m", "exp:1s:5m:nojitter"."""
    if backoff.get("kind") == "fixed":
        return f"fixed:{compact_duration(backoff['delay_ms'])}"
    text = f"exp:{compact_duration(backoff['base_ms'])}:{compact_duration(backoff['max_ms'])}"
    return text if backoff.get("jitter", True) else text + ":nojitter"


def limits_text(config: QueueConfig) -> Text:
    """A queue's limits in a few cells ("max 5 · 100/s"), empty if it has none."""
    parts = []
    if config.max_leased is not None:
        parts.append(f"max {config.max_leased}")
    if config.rate is not None:
        parts.append(rate_text(config.rate))
    return Text(" · ".join(parts), style="cyan")


def defaults_text(config: QueueConfig) -> Text:
    """A queue's submit defaults in a few cells ("30s · 3 retries · exp:1s:5m"), empty if
    it has none."""
    parts = []
    if config.default_timeout_ms is not None:
        parts.append(compact_duration(config.default_timeout_ms))
    if config.default_retries is not None:
        parts.append(f"{config.default_retries} retr" + ("y" if config.default_retries == 1
                                                          else "ies"))  # fmt: skip
    if config.default_backoff is not None:
        parts.append(backoff_text(config.default_backoff))
    return Text(" · ".join(parts))


def _setting(value: str | None, unset: str) -> Text:
    if value is None:
        return Text(f"- ({unset})", style="dim")
    return Text(value)


def queue_panel(config: QueueConfig) -> Fitted:
    """``relay-trio queue show`` (a ``QueueInfo``: with its jobs per state below) and
    ``queue set`` (the settings the change left): each setting as ``queue set`` takes it,
    and what applies where it is not set. At most 80 cells wide (the jobs' table takes
    about 60); the queue name in the title, cut in the middle if need be (``--json`` has
    it whole)."""
    return Fitted(functools.partial(_queue_panel_layout, config))


def _queue_panel_layout(config: QueueConfig, width: int) -> RenderableType:
    fields = Table.grid(padding=(0, 2))
    fields.add_column(style="bold", no_wrap=True)
    fields.add_column(overflow="fold")
    fields.add_row("paused", Text("yes: no worker leases its jobs", style="bold yellow")
                   if config.paused else Text("no"))  # fmt: skip
    fields.add_row(
        "max leased",
        _setting(
            None if config.max_leased is None else f"{config.max_leased} jobs at once", "no limit"
        ),
    )
    fields.add_row(
        "rate",
        _setting(None if config.rate is None else f"{rate_text(config.rate)} (leases)", "no limit"),
    )
    timeout = config.default_timeout_ms
    fields.add_row(
        "default timeout",
        _setting(None if timeout is None else compact_duration(timeout), "the submit's, else none"),
    )
    retries = config.default_retries
    fields.add_row(
        "default retries",
        _setting(None if retries is None else str(retries), "the submit's, else 3"),
    )
    backoff = config.default_backoff
    fields.add_row(
        "default backoff",
        _setting(
            None if backoff is None else backoff_text(backoff), "the submit's, else exp:1s:5m"
        ),
    )
    parts: list[RenderableType] = [fields]
    if isinstance(config, QueueInfo):
        counts = config.counts
        states = shown_states(counts)
        cells = [count_text(counts.get(state, 0), state) for state in states]
        cells.append(Text(short_number(sum(counts.get(state, 0) for state in STATES))))
        jobs = plain_table(gap=NUMBERS_GAP)
        for header in [*states, "total"]:
            jobs.add_column(header, justify="right", no_wrap=True,
                            header_style=STATE_STYLES.get(header, ""))  # fmt: skip
        jobs.add_row(*cells)
        parts += [Text(), jobs]
    return Panel(
        Group(*parts),
        title=Text(cut_middle(config.queue, min(width, 80) - 6), style="bold"),
        title_align="left",
        border_style="yellow" if config.paused else "",
        width=min(width, 80),
        expand=False,
    )


# -- schedules ----------------------------------------------------------------------------

# From this width on, the schedule table also shows each one's queue and catch-up policy.
SCHEDULE_WIDE = 120


def _slot_text(ms: int, tz: str, seconds: bool) -> tuple[str, str]:
    """A slot as its zone's local time (with the zone's abbreviation) and as UTC."""
    shown = "%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M"
    at = dt.datetime.fromtimestamp(ms / 1000, dt.UTC)
    local = at.astimezone(zone(tz))
    return f"{local:{shown}} {local.tzname()}", f"{at:{shown}} UTC"


def next_run_line(info: ScheduleInfo) -> str:
    """A schedule's next run in one line: its local time, and UTC when that differs."""
    if info.paused:
        return "none: paused"
    if info.next_at is None:
        return "none: the expression has no slot left"
    local, utc = _slot_text(info.next_at, info.timezone, len(info.cron.split()) == 6)
    return local if local.endswith(" UTC") else f"{local} ({utc})"


def schedule_table(page: SchedulePage, *, short: Mapping[str, str] | None = None) -> Fitted:
    """``relay-trio schedule list``: one row per schedule, by name: its expression and zone,
    its next run in the zone's local time and in UTC (two lines, one for a UTC schedule),
    its last job (the id as ``short`` gives it, see ``short_ids``) and that job's state
    now, marked when the last slot made no job (a line under the table says why).

    At 80 columns the next run takes 20 cells ("2026-03-02 04:00 CET" over "2026-03-02
    03:00 UTC"), a short id 11 to 20, and the expression gets the rest but QUEUE_MIN (12)
    for the name: an expression of 20 characters is whole, and a name of 14. From
    SCHEDULE_WIDE (120) on, the queue (up to 30 characters) and the catch-up policy have
    columns too, and the name and the expression share about 40. An expression too long
    for its room is cut in the middle; a name is folded onto more lines (it is what a user
    types back). Below a narrow table, a line says where the queue and catch-up are."""
    return Fitted(functools.partial(_schedule_layout, page, short))


def _schedule_layout(
    page: SchedulePage, short: Mapping[str, str] | None, width: int
) -> RenderableType:
    schedules = page.schedules
    wide = width >= SCHEDULE_WIDE
    ids = short_ids((s.last_job_id for s in schedules if s.last_job_id), short)
    nexts, lasts = [], []
    for info in schedules:
        if info.paused:
            nexts.append(Text("paused", style="bold yellow"))
        elif info.next_at is None:
            nexts.append(Text("never", style="dim"))
        else:
            local, utc = _slot_text(info.next_at, info.timezone, len(info.cron.split()) == 6)
            text = Text(local)
            if utc != local:  # (a UTC schedule's time once)
                text.append("\n" + utc, style="dim")
            nexts.append(text)
        if info.last_job_id is None:
            text = Text("-", style="dim")
        else:
            text = Text(ids[info.last_job_id] + "\n")
            text.append_text(
                state_text(info.last_job_state)
                if info.last_job_state
                else Text("pruned", style="dim")
            )
        if info.last_refusal is not None:
            text.append("\nlast slot: no job", style="bold red")
        lasts.append(text)
    crons = [f"{s.cron}\n{s.timezone}" for s in schedules]
    headers = ["schedule", "cron", "next run", "last job"]
    extra = [[s.queue for s in schedules], [s.catch_up for s in schedules]] if wide else []
    extra_headers = ["queue", "catch-up"] if wide else []
    fixed = [column_width(headers[2], [_widest_line(t) for t in nexts] or ["never"]),
             column_width(headers[3], [_widest_line(t) for t in lasts])]  # fmt: skip
    extra_widths = [
        min(column_width(h, cells), 30) for h, cells in zip(extra_headers, extra, strict=True)
    ]
    room = width - tables_width([0, 0, *fixed, *extra_widths])
    longest_cron = column_width("cron", [_widest_line(Text(cron)) for cron in crons])
    # The expression whole first (a name cut in the middle still reads), QUEUE_MIN to
    # the name at least; then the name takes what is left.
    cron_width = max(9, min(longest_cron, room - QUEUE_MIN))
    name_width = queue_width([headers[0], *(s.name for s in schedules)], room - cron_width)

    table = plain_table("Schedules")
    # A name is what `schedule pause NAME` takes back: folded onto more lines, never cut.
    table.add_column(headers[0], width=name_width, overflow="fold")
    table.add_column(headers[1], width=cron_width, no_wrap=True)
    for header, w in zip(extra_headers, extra_widths, strict=True):
        table.add_column(header, width=w, no_wrap=True)
    table.add_column(headers[2], width=fixed[0], no_wrap=True)
    table.add_column(headers[3], width=fixed[1], no_wrap=True)
    for n, info in enumerate(schedules):
        cells = [info.name,
                 Text(cut_middle(info.cron, cron_width) + "\n", style="bold").append(
                     cut_middle(info.timezone, cron_width), style="dim")]  # fmt: skip
        cells += [cut_middle(column[n], w) for column, w in zip(extra, extra_widths, strict=True)]
        table.add_row(*cells, nexts[n], lasts[n])
    if not schedules:
        table.add_row(Text("no schedules yet", style="dim"), *("" for _ in range(3 + len(extra))))
    notes = [
        Text(f"{info.name}: its last slot made no job: {info.last_refusal}", style="red")
        for info in schedules
        if info.last_refusal is not None
    ]
    if schedules and not wide:
        notes.append(Text(f"queues and catch-up: --json, or {SCHEDULE_WIDE} columns",
                          style="table.caption"))  # fmt: skip
    if page.next_cursor is not None:
        notes.append(Text(f"next page: --cursor {page.next_cursor}", style="table.caption"))
    return Group(table, *notes) if notes else table


def _widest_line(text: Text) -> str:
    """The widest of a cell's lines: what its column needs."""
    return max(text.plain.split("\n"), key=cell_len)


def dead_table(
    page: DeadPage,
    *,
    full_ids: bool = False,
    caption: str | None = None,
    short: Mapping[str, str] | None = None,
) -> Fitted:
    """One row per dead job: its id (as ``short`` maps it, the server's abbreviations, else
    the shortest abbreviation unique among the rows, see ``short_ids``; whole with
    ``full_ids``), queue, attempts, when it failed (UTC, to the
    minute) and the first line of its last error, which gets the rest of the width. Below
    it, ``caption`` (the order and how to get the next page: ``relay-trio dead list``
    says), or else the next page's cursor, if there is one.

    The queue and the error share what the other columns leave: at 80 columns, 51 less
    the id column's width (with tries of up to 5 characters, "10/10"); at 120, 91 less
    it. With ids of 7 digits (11 characters: no other job made within ~33 s of it), a
    queue name of up to 15 characters is whole at 80 columns and the error gets 25. Ids
    of jobs made among others of other milliseconds keep 8 to 12 digits; ids made in one
    millisecond (a batch's) 12 to 16, most often 15 or 16: 16 to 20
    characters, the width of whole ids at most, which leaves a queue name 12 and the
    error 19 to 23. At 120, a queue name of 40 is whole and the error gets 31 to 40. A
    longer name is cut in the middle (``cut_middle``), to QUEUE_MIN characters at the
    least, then the error at its end; ``relay-trio inspect`` shows both whole.
    """
    return Fitted(functools.partial(_dead_layout, page, full_ids, caption, short))


def _dead_layout(
    page: DeadPage,
    full_ids: bool,
    caption: str | None,
    short: Mapping[str, str] | None,
    width: int,
) -> RenderableType:
    jobs = page.jobs
    ids = short_ids((job.job_id for job in jobs), short)
    if full_ids:
        ids = {job_id: job_id for job_id in ids}
    tries = [f"{job.attempt}/{job.max_attempts}" for job in jobs]
    times = [format_minute(failed_at(job)) for job in jobs]
    errors = [truncate(job.last_error) for job in jobs]
    headers = ("id", "queue", "tries", "failed at (UTC)", "last error")
    shown_ids = list(ids.values()) or ["no dead jobs"]
    fixed = [column_width(headers[0], shown_ids), column_width(headers[2], tries),
             column_width(headers[3], times)]  # fmt: skip
    queue, error = share_room(width - tables_width([*fixed, 0, 0]),
                              [headers[1], *(job.queue for job in jobs)],
                              [headers[4], *errors])  # fmt: skip

    table = plain_table("Dead jobs")
    table.add_column(headers[0], width=fixed[0], no_wrap=True)
    table.add_column(headers[1], width=queue, no_wrap=True)
    table.add_column(headers[2], width=fixed[1], no_wrap=True, justify="right")
    table.add_column(headers[3], width=fixed[2], no_wrap=True)
    table.add_column(headers[4], width=error, no_wrap=True, style="red")
    for job, shown_time, attempts, last_error in zip(jobs, times, tries, errors, strict=True):
        table.add_row(ids[job.job_id], cut_middle(job.queue, queue), attempts, shown_time,
                      truncate(last_error, error))  # fmt: skip
    if not jobs:
        table.add_row(Text("no dead jobs", style="dim"), "", "", "", "")
    if caption is None and page.next_cursor is not None:
        caption = f"more dead jobs: --cursor {page.next_cursor}"
    if caption is None:
        return table
    return Group(table, Text(caption, style="table.caption"))


# -- the job browser ----------------------------------------------------------------------

# The width from which ``jobs_table`` shows the worker that last leased each job, and the
# year of its times (below, "12-03 14:05": the error gets those 5 columns).
JOBS_WORKER_AT = 110
JOBS_YEAR_AT = 100


def job_time(job: JobSummary) -> int | None:
    """The time that matters in a job's state: when it finished, when it is due (pending,
    retrying), since when it is ready, when its lease expires."""
    if job.finished_at is not None:
        return job.finished_at
    if job.state in (JobState.PENDING, JobState.RETRYING):
        return job.run_at
    if job.state == JobState.LEASED:
        return job.lease_expires_at
    return job.ready_at if job.ready_at is not None else job.created_at


def jobs_table(
    page: JobsPage,
    *,
    full_ids: bool = False,
    caption: str | None = None,
    short: Mapping[str, str] | None = None,
) -> Fitted:
    """``relay-trio jobs list``: one row per job, its id (as ``dead_table`` shows it),
    queue, state (in its colour), tries, the time that matters in its state (``job_time``,
    UTC to the minute; its year from JOBS_YEAR_AT columns) and the first line of its last
    error, which gets the rest of the width; from JOBS_WORKER_AT columns also the worker
    that last leased it. Below it,
    ``caption`` (the order and how to get the next page), or else the next page's cursor.

    The queue and the error share what the other columns leave, as in ``dead_table``: the
    state column takes 9 more at most ("cancelled", "succeeded").
    """
    return Fitted(functools.partial(_jobs_layout, page, full_ids, caption, short))


def _jobs_layout(
    page: JobsPage,
    full_ids: bool,
    caption: str | None,
    short: Mapping[str, str] | None,
    width: int,
) -> RenderableType:
    jobs = page.jobs
    ids = short_ids((job.job_id for job in jobs), short)
    if full_ids:
        ids = {job_id: job_id for job_id in ids}
    states = [str(job.state) for job in jobs]
    tries = [f"{job.attempt}/{job.max_attempts}" for job in jobs]
    times = [format_minute(job_time(job)) for job in jobs]
    if width < JOBS_YEAR_AT:
        times = [time[5:] if time != "-" else time for time in times]
    errors = [truncate(job.last_error) for job in jobs]
    workers = [printable(job.worker_id or "-") for job in jobs]
    headers = ("id", "queue", "state", "tries", "at (UTC)", "worker", "last error")
    shown_ids = list(ids.values()) or ["no jobs"]
    fixed = [column_width(headers[0], shown_ids), column_width(headers[2], states),
             column_width(headers[3], tries), column_width(headers[4], times)]  # fmt: skip
    worker = 0
    if width >= JOBS_WORKER_AT:
        worker = min(column_width(headers[5], workers), 16)
        fixed.append(worker)
    queue, error = share_room(width - tables_width([*fixed, 0, 0]),
                              [headers[1], *(job.queue for job in jobs)],
                              [headers[6], *errors])  # fmt: skip

    table = plain_table("Jobs")
    table.add_column(headers[0], width=fixed[0], no_wrap=True)
    table.add_column(headers[1], width=queue, no_wrap=True)
    table.add_column(headers[2], width=fixed[1], no_wrap=True)
    table.add_column(headers[3], width=fixed[2], no_wrap=True, justify="right")
    table.add_column(headers[4], width=fixed[3], no_wrap=True)
    if worker:
        table.add_column(headers[5], width=worker, no_wrap=True)
    table.add_column(headers[6], width=error, no_wrap=True, style="red")
    for job, state, attempts, shown_time, name, last_error in zip(
        jobs, states, tries, times, workers, errors, strict=True
    ):
        cells: list[str | Text] = [ids[job.job_id], cut_middle(job.queue, queue),
                                   state_text(state), attempts, shown_time]  # fmt: skip
        if worker:
            cells.append(cut_middle(name, worker))
        table.add_row(*cells, truncate(last_error, error))
    if not jobs:
        table.add_row(Text("no jobs", style="dim"), *[""] * (5 + bool(worker)))
    if caption is None and page.next_cursor is not None:
        caption = f"more jobs: --after {page.next_cursor}"
    if caption is None:
        return table
    return Group(table, Text(caption, style="table.caption"))


# -- one job ------------------------------------------------------------------------------

# The timing fields of a job, in the order they happen.
_TIMES = (
    ("created", "created_at"),
    ("run at", "run_at"),
    ("ready at", "ready_at"),
    ("lease expires", "lease_expires_at"),
    ("finished", "finished_at"),
)


OUTCOME_STYLES: Mapping[str, str] = {
    "running": "yellow",
    "succeeded": "green",
    "failed": "red",
    "expired": "magenta",
    "timed_out": "magenta",
    "released": "dim",
    "cancelled": "dim",
    "interrupted": "dim",
}
# Below this panel width, an attempt's start is shown without its year and millis, and its
# worker id in at most ATTEMPT_WORKER_NARROW cells, so that its error keeps some room.
ATTEMPTS_WIDE = 110
ATTEMPT_WORKER_NARROW, ATTEMPT_WORKER_WIDE = 14, 32


def _attempt_start(ms: int | None, wide: bool) -> str:
    if ms is None:  # (recorded by a relay-trio that did not keep it)
        return "-"
    if wide:
        return format_time(ms).removesuffix(" UTC")
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%m-%d %H:%M:%S")


def _attempt_took(entry: AttemptEntry) -> str:
    if entry.started_at is None or entry.ended_at is None:
        return "-"
    return format_duration(max(0, entry.ended_at - entry.started_at))


def _attempts_table(job: JobView, width: int) -> Table:
    """The job's attempts as a timeline, oldest first, one line each: its number, start,
    how long it took, worker, outcome and the first line of its error."""
    wide = width >= ATTEMPTS_WIDE
    table = plain_table()
    title = "attempts"
    if job.attempts_dropped:
        title += f" ({job.attempts_dropped} older ones not kept)"
    table.title, table.title_justify = title, "left"
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("start (UTC)", no_wrap=True)
    table.add_column("took", justify="right", no_wrap=True)
    worker_cells = ATTEMPT_WORKER_WIDE if wide else ATTEMPT_WORKER_NARROW
    table.add_column("worker", no_wrap=True, overflow="ellipsis", max_width=worker_cells)
    table.add_column("outcome", no_wrap=True)
    # The rest of the panel's width (its border and padding take 4): ratio=1 with expand.
    table.add_column("error", style="red", no_wrap=True, overflow="ellipsis", ratio=1)
    table.expand = True
    for entry in job.attempts:
        outcome = str(entry.outcome)
        table.add_row(
            str(entry.attempt),
            _attempt_start(entry.started_at, wide),
            _attempt_took(entry),
            Text(printable(entry.worker_id or "-")),
            Text(outcome.replace("_", " "), style=OUTCOME_STYLES.get(outcome, "")),
            Text(truncate(entry.error)),
        )
    return table


def _time_cell(ms: int) -> Text:
    text = Text(format_time(ms))
    text.append(f"  ({ms})", style="dim")
    return text


def _json(value: Any) -> RenderableType:
    """A payload or result as indented JSON, a long line folded, never cut: it is the job's
    own data (rich's JSON does not wrap)."""
    try:
        text = JSON.from_data(value, indent=2).text
    except (TypeError, ValueError):
        text = Text(repr(value))
    text.no_wrap, text.overflow = False, "fold"
    return text


def job_panel(job: JobView) -> Fitted:
    """Everything ``inspect`` knows of a job: state, queue, priority, attempts, timings (UTC
    and raw ms), worker, last error, the attempts as a timeline (a server without them:
    the error history), the traceback of the latest failed attempt that has one, the
    payload and the result.

    The job's own values are shown whole, a long one on as many lines as it needs: the
    whole id in the title, a queue name of up to 128 characters, the last error with its
    traceback. The error history has one line per attempt: the first line of each error,
    cut to the width (the last one is whole above; ``--json`` has every one whole)."""
    return Fitted(functools.partial(_job_layout, job))


def _job_layout(job: JobView, width: int) -> RenderableType:
    fields = Table.grid(padding=(0, 2))
    fields.add_column(style="bold", no_wrap=True)
    fields.add_column(overflow="fold")
    fields.add_row("state", state_text(job.state))
    fields.add_row("queue", job.queue)
    fields.add_row("priority", priority_text(job.priority))
    fields.add_row("attempts", f"{job.attempt} of {job.max_attempts}")
    if job.timeout_ms is not None:
        fields.add_row("timeout", f"{format_duration(job.timeout_ms)} per attempt")
    for label, name in _TIMES:
        ms = getattr(job, name)
        if ms is not None:
            fields.add_row(label, _time_cell(ms))
    if job.finished_at is not None:
        fields.add_row("total time", format_duration(max(0, job.finished_at - job.created_at)))
    if job.worker_id is not None:
        fields.add_row("worker", printable(job.worker_id))
    if job.idempotency_key is not None:
        fields.add_row("idempotency key", printable(job.idempotency_key))
    if job.last_error is not None:
        fields.add_row("last error", Text(printable(job.last_error), style="red"))

    parts: list[RenderableType] = [fields]
    if job.attempts:
        parts += [Text(), _attempts_table(job, width)]
    elif job.errors:  # (a server without the attempt history)
        errors = plain_table()
        errors.title, errors.title_justify = "errors", "left"
        errors.add_column("attempt", justify="right", no_wrap=True)
        errors.add_column("at (UTC)", no_wrap=True)
        # The rest of the panel's width (its border and padding take 4): ratio=1 with expand.
        errors.add_column("error", style="red", no_wrap=True, overflow="ellipsis", ratio=1)
        errors.expand = True
        for entry in job.errors:
            errors.add_row(str(entry.attempt), format_time(entry.at).removesuffix(" UTC"),
                           truncate(entry.error))  # fmt: skip
        parts += [Text(), errors]
    if job.errors:
        # The latest traceback the worker sent (the others: --json), folded, not cut: the
        # failing frame and the exception are at its end.
        traced = next((entry for entry in reversed(job.errors) if entry.traceback), None)
        if traced is not None:
            assert traced.traceback is not None
            parts += [
                Text(),
                Text(f"traceback of attempt {traced.attempt}", style="bold"),
                Text(printable(traced.traceback), style="dim", overflow="fold"),
            ]
    parts += [Text(), Text("payload", style="bold"), _json(job.payload)]
    if job.result is not None:
        parts += [Text(), Text("result", style="bold"), _json(job.result)]
    return Panel(
        Group(*parts),
        title=Text(job.job_id, style="bold"),
        title_align="left",
        subtitle=state_text(job.state),
        subtitle_align="right",
        border_style=STATE_STYLES.get(str(job.state), ""),
        width=width,
    )


# -- history ------------------------------------------------------------------------------

# The history's sparkline, eight heights; a step with nothing is a space's width of "·".
SPARKS = "▁▂▃▄▅▆▇█"
# A step's bar (``history_table``, where the width leaves it room): succeeded, then failed.
BAR_SUCCEEDED, BAR_FAILED = "█", "▒"
BAR_MIN = 10  # cells: below this, no bar column
HISTORY_COUNTS = ("submitted", "succeeded", "failed", "dead")


def sparkline(values: Sequence[int | None]) -> str:
    """One character per value, its height by its share of the largest: "·" for none, a
    space for a value not known (``top``'s steps before it started)."""
    top = max((v for v in values if v), default=0)
    n = len(SPARKS)
    return "".join(" " if v is None else "·" if not v else SPARKS[-(-v * n // top) - 1]
                   for v in values)  # fmt: skip


def step_text(ms: int) -> str:
    """A history's step, whole minutes: "1m", "15m", "1h", "90m", "1d"."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms // 60_000}m"


def _mean_text(total_ms: int, count: int) -> str:
    return short_duration(round(total_ms / count)) if count else "-"


def _max_text(ms: int, count: int) -> str:
    return short_duration(ms) if count else "-"


def history_table(history: History) -> Fitted:
    """A ``history`` reply as a table: a row per step (its start, UTC), the jobs
    submitted, succeeded, failed (attempts) and dead, the mean and longest run and wait;
    a totals row. Where the width leaves room: a bar per step (succeeded █, failed ▒, to
    the largest step's scale) and, when every step fits in a line, the sparklines of the
    jobs succeeded and failed over the range."""
    return Fitted(functools.partial(_history_layout, history))


def _history_layout(history: History, width: int) -> RenderableType:
    points = history.points
    span_days = history.end - history.start > 86_400_000 or (
        format_minute(history.start)[:10] != format_minute(history.end - 1)[:10]
    )
    label = (lambda ms: format_minute(ms)[5:]) if span_days else (lambda ms: format_minute(ms)[11:])
    rows: list[list[str]] = []
    for p in points:
        rows.append([
            label(p.at), *(short_number(getattr(p, name)) for name in HISTORY_COUNTS),
            _mean_text(p.run_sum_ms, p.run_count), _max_text(p.run_max_ms, p.run_count),
            _mean_text(p.wait_sum_ms, p.wait_count), _max_text(p.wait_max_ms, p.wait_count),
        ])  # fmt: skip
    sums = {name: sum(getattr(p, name) for p in points) for name in HistoryPoint.__annotations__}
    run_count, wait_count = sums["run_count"], sums["wait_count"]
    total = [
        "total", *(short_number(sums[name]) for name in HISTORY_COUNTS),
        _mean_text(sums["run_sum_ms"], run_count),
        _max_text(max((p.run_max_ms for p in points), default=0), run_count),
        _mean_text(sums["wait_sum_ms"], wait_count),
        _max_text(max((p.wait_max_ms for p in points), default=0), wait_count),
    ]  # fmt: skip
    headers = ["UTC", "sub-\nmitted", "suc-\nceeded", "failed", "dead", "run\nmean", "run\nmax",
               "wait\nmean", "wait\nmax"]  # fmt: skip
    widths = [column_width(h, [r[i] for r in [*rows, total]]) for i, h in enumerate(headers)]
    room = width - tables_width(widths, NUMBERS_GAP) - NUMBERS_GAP
    bar = room if room >= BAR_MIN else 0
    step = step_text(history.step)
    title = (
        f"{history.queue or 'every queue'} · {format_minute(history.start)} to "
        f"{format_minute(history.end)[11 if not span_days else 0 :]} UTC · per {step}"
    )
    table = plain_table(title, gap=NUMBERS_GAP)
    table.title_justify = "left"
    table.add_column(headers[0], width=widths[0], no_wrap=True)
    for header, column in zip(headers[1:], widths[1:], strict=True):
        table.add_column(header, justify="right", width=column, no_wrap=True)
    if bar:
        table.add_column("", width=bar, no_wrap=True)
    top = max((p.succeeded + p.failed for p in points), default=0)
    for p, cells in zip(points, rows, strict=True):
        extra: list[RenderableType] = []
        if bar:
            ok = -(-p.succeeded * bar // top) if top else 0
            bad = -(-p.failed * bar // top) if top else 0
            if ok + bad > bar:
                ok = bar - bad
            extra = [Text.assemble((BAR_SUCCEEDED * ok, "green"), (BAR_FAILED * bad, "red"))]
        table.add_row(*cells, *extra)
    table.add_section()
    table.add_row(*total, *([""] if bar else []), style="bold")
    parts: list[RenderableType] = [table]
    if points and len(points) + 12 <= width:
        for name, style in (("succeeded", "green"), ("failed", "red")):
            line = sparkline([getattr(p, name) for p in points])
            parts.append(Text.assemble((f"{name:>10} ", "bold"), (line, style)))
    return Group(*parts)


# -- demo progress ------------------------------------------------------------------------


def state_progress(console: Console | None = None) -> tuple[Progress, dict[str, TaskID]]:
    """A progress display with one bar per job state (all jobs as the total), and the task
    of each state. Feed it with ``update_state_progress``. Its 9 + 40 + 11 cells (name, bar,
    "10000/10000") fit 80 columns."""
    progress = Progress(
        TextColumn("{task.description}", justify="right"),
        BarColumn(bar_width=40),
        MofNCompleteColumn(),
        console=console,
    )
    tasks = {
        state: progress.add_task(f"[{STATE_STYLES[state]}]{state:>9}", total=1, completed=0)
        for state in STATES
    }
    return progress, tasks


def update_state_progress(progress: Progress, tasks: Mapping[str, TaskID], stats: Stats) -> None:
    """Set each bar to its state's count, out of every job in ``stats``."""
    totals = totals_by_state(stats)
    total = max(1, sum(totals.values()))
    for state, task in tasks.items():
        progress.update(task, completed=totals.get(state, 0), total=total)


# -- workers ------------------------------------------------------------------------------

# The widths the worker, client, address and queues columns of ``relay-trio workers`` get
# first (or less, if their longest cell is shorter); the room left then goes to them in the
# order of WORKER_ROOM_ORDER, up to their longest cell.
WORKER_FIRST = {"worker": 12, "client": 8, "address": 15, "queues": 10}
WORKER_ROOM_ORDER = ("worker", "queues", "address", "client")


def idle_queues(stats: Stats, workers: Iterable[WorkerInfo]) -> list[str]:
    """The queues of ``stats`` with ready jobs that no worker of ``workers`` asks for (a
    queue not paused: a paused one's jobs wait on purpose), by name."""
    asked = {queue for worker in workers for queue in worker.queues}
    paused = set(stats.paused)
    return [
        queue for queue, counts in sorted(stats.queues.items())
        if counts.get("ready", 0) and queue not in asked and queue not in paused
    ]  # fmt: skip


def workers_table(
    page: WorkersPage, stats: Stats | None = None, *, more: int = 0, partial: bool = False
) -> Fitted:
    """``relay-trio workers``: one row per connected worker of the server ``page.server``:
    its worker id, client name, address, the queues it asks for, the jobs it holds, the
    longest it has held one ("?" when the server does not know since when: leased before a
    reconnect), and how long since its last request. Under it, with ``stats`` (a page of
    the server's counts), the queues with ready jobs that no worker asks for, as a second
    table with how long their oldest ready job has waited: such a queue is stuck, not slow.
    ``more``: the workers not shown (a line says how to see them); ``partial``: the
    workers were not all read, so the second table may name a queue a worker asks for.

    The three columns of numbers take 17 cells; the room left is shared by the texts
    (WORKER_FIRST, then WORKER_ROOM_ORDER), each cut in the middle where it must be."""
    return Fitted(functools.partial(_workers_layout, page, stats, more, partial))


def _workers_layout(
    page: WorkersPage, stats: Stats | None, more: int, partial: bool, width: int
) -> RenderableType:
    workers = page.workers
    texts: dict[str, list[str]] = {"worker": [], "client": [], "address": [], "queues": []}
    numbers: list[list[Text]] = []
    for worker in workers:
        texts["worker"].append(printable(worker.worker_id))
        texts["client"].append(printable(worker.client or "-"))
        texts["address"].append(worker.peer)
        queues = ",".join(worker.queues)
        if worker.queues_total > len(worker.queues):
            queues += f" +{worker.queues_total - len(worker.queues)}"
        texts["queues"].append(queues)
        longest = worker.longest_held_ms
        held = "-" if not worker.jobs_held else "?" if longest is None else short_duration(longest)
        idle = short_duration(max(0, page.at - worker.last_request_at))
        numbers.append([Text(short_number(worker.jobs_held)), Text(held),
                        Text(idle + (" *" if worker.parked else ""))])  # fmt: skip
    headers = ["jobs", "longest\nheld", "idle"]
    fixed = [column_width(h, [row[i] for row in numbers]) for i, h in enumerate(headers)]
    longest_text = {name: column_width(name, cells) for name, cells in texts.items()}
    widths = {name: min(longest_text[name], first) for name, first in WORKER_FIRST.items()}
    widths = {name: max(w, len(name)) for name, w in widths.items()}
    room = width - tables_width([*widths.values(), *fixed])
    for name in WORKER_ROOM_ORDER:
        more_room = max(0, min(room, longest_text[name] - widths[name]))
        widths[name] += more_room
        room -= more_room

    title = f"Workers of {page.server}"
    table = plain_table(title)
    for name in WORKER_FIRST:
        table.add_column(name, width=widths[name], no_wrap=True)
    for header, w in zip(headers, fixed, strict=True):
        table.add_column(header, width=w, justify="right", no_wrap=True)
    for i, row in enumerate(numbers):
        table.add_row(*(cut_middle(texts[name][i], widths[name]) for name in WORKER_FIRST),
                      *row)  # fmt: skip
    shown = f"{len(workers)} worker" + ("" if len(workers) == 1 else "s")
    notes: list[RenderableType] = [table]
    if not workers:
        notes = [Text(title, style="table.title"),
                 Text("no worker connected to this server", style="dim")]  # fmt: skip
    caption = f"{shown} · each server lists its own"
    if any(worker.parked for worker in workers):
        caption += " · * waiting for jobs"
    notes.append(Text(caption, style="table.caption"))
    if more:
        notes.append(Text(f"and {more} more: --limit N shows more", style="table.caption"))
    if stats is not None:
        notes.append(_idle_queues_table(stats, workers, partial, width))
    return Group(*notes)


def _idle_queues_table(
    stats: Stats, workers: Sequence[WorkerInfo], partial: bool, width: int
) -> RenderableType:
    idle = idle_queues(stats, workers)
    if not idle:
        return Text("every queue with ready jobs has a worker", style="table.caption")
    oldest = stats.oldest_ready_ms or {}
    rows = [[Text(short_number(stats.queues[q]["ready"]), style=STATE_STYLES["ready"]),
             Text("-" if oldest.get(q) is None else short_duration(oldest[q]))]
            for q in idle]  # fmt: skip
    headers = ["ready", OLDEST_READY]
    widths = [column_width(h, [row[i] for row in rows]) for i, h in enumerate(headers)]
    queue = queue_width([*idle, "queue"], width - tables_width([0, *widths]))
    # (This server's workers: with several servers on one database, another's may serve
    # them, and its own `workers` lists those.)
    title = "Ready jobs and no worker on this server" + (
        " (of the workers read)" if partial else ""
    )
    table = plain_table()
    table.add_column("queue", width=queue, no_wrap=True, style="bold red")
    for header, w in zip(headers, widths, strict=True):
        table.add_column(header, width=w, justify="right", no_wrap=True)
    for name, row in zip(idle, rows, strict=True):
        table.add_row(cut_middle(name, queue), *row)
    return Group(Text(""), Text(title, style="table.title"), table)
