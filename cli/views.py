"""Data in, rich renderables out: the tables, panels and progress bars of the command line.

Pure functions over the client's typed results (``Stats``, ``DeadPage``, ``JobView``): no
I/O and no clock reads, so each view is tested by rendering it into
``Console(file=io.StringIO(), width=100)``. Times are shown in UTC next to their raw
milliseconds, so what the terminal shows can be matched with what ``--json`` prints.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.json import JSON
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table
from rich.text import Text

from relay.client import DeadPage, JobView, Stats
from relay.model import JobState

STATES: tuple[str, ...] = tuple(str(state) for state in JobState)
UNFINISHED: tuple[str, ...] = tuple(str(s) for s in JobState if not s.terminal)

STATE_STYLES: Mapping[str, str] = {
    "pending": "cyan",
    "ready": "blue",
    "leased": "yellow",
    "retrying": "magenta",
    "succeeded": "green",
    "dead": "red",
}
PRIORITY_STYLES: Mapping[str, str] = {
    "low": "dim",
    "normal": "",
    "high": "bold",
    "critical": "bold red",
}

# The dead table shows the first line of the last error, cut to this many characters: a
# row per job stays one line high, and the whole text is one `relay-trio inspect` away.
ERROR_CHARS = 60
ELLIPSIS = "…"
JOB_ID_CHARS = 20  # "job_" and 16 hex digits
QUEUE_CHARS = 24  # a longer queue name is cut in the dead table (they may have 128)


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
    """``format_duration`` in two units at most ("1h 02m", "3d 04h"): a table's column."""
    if ms < 3_600_000:
        return format_duration(ms)
    return format_duration(ms).rsplit(" ", 1)[0]


def truncate(text: str | None, limit: int = ERROR_CHARS) -> str:
    """The first line of ``text``, at most ``limit`` characters (ending in "…" if cut)."""
    if not text:
        return ""
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    if len(lines) > 1 or len(first) > limit:
        return first[: limit - 1] + ELLIPSIS
    return first


def state_text(state: str) -> Text:
    return Text(str(state), style=STATE_STYLES.get(str(state), ""))


def priority_text(priority: str) -> Text:
    return Text(priority, style=PRIORITY_STYLES.get(priority, ""))


def totals_by_state(stats: Stats) -> dict[str, int]:
    """Jobs per state over every queue (every state present, zeros included)."""
    totals = dict.fromkeys(STATES, 0)
    for counts in stats.queues.values():
        for state, count in counts.items():
            totals[state] = totals.get(state, 0) + count
    return totals


def unfinished(stats: Stats) -> int:
    """Jobs that are not succeeded or dead yet (pending, ready, leased, retrying)."""
    totals = totals_by_state(stats)
    return sum(totals[state] for state in UNFINISHED)


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


def _count(count: int, state: str | None = None) -> Text:
    if count == 0:
        return Text("0", style="dim")
    return Text(short_number(count), style=STATE_STYLES.get(state or "", ""))


def stats_table(stats: Stats) -> Table:
    """Queues (rows, sorted by name) by states (columns), a total per queue, how long its
    oldest ready job has waited, and a totals row; the server's version, uptime and
    connections in the caption."""
    server = stats.server
    connections = f"{server.connections} connection" + ("" if server.connections == 1 else "s")
    table = Table(
        title="Queues",
        caption=f"relay-trio {server.version} · up {format_duration(server.uptime_ms)} · "
        f"{connections}",
        caption_justify="left",
    )
    # Fits 80 columns: no vertical rules, numbers and headings never cut (a long queue
    # name folds instead), "oldest ready" on two lines.
    table.box = box.SIMPLE_HEAD
    table.pad_edge = False
    table.collapse_padding = True
    table.add_column("queue", overflow="fold", min_width=8)
    for state in STATES:
        table.add_column(
            state, justify="right", header_style=STATE_STYLES[state], no_wrap=True,
            min_width=len(state),
        )  # fmt: skip
    table.add_column("total", justify="right", style="bold", no_wrap=True, min_width=5)
    table.add_column("oldest\nready", justify="right", no_wrap=True, min_width=6)
    oldest = stats.oldest_ready_ms or {}
    for name in sorted(stats.queues):
        counts = stats.queues[name]
        wait = oldest.get(name)
        table.add_row(
            name,
            *(_count(counts.get(state, 0), state) for state in STATES),
            short_number(sum(counts.values())),
            "-" if wait is None else short_duration(wait),
        )
    if not stats.queues:
        table.add_row(Text("no jobs yet", style="dim"), *("" for _ in STATES), "", "")
    totals = totals_by_state(stats)
    table.add_section()
    table.add_row(
        Text("total", style="bold"),
        *(_count(totals[state], state) for state in STATES),
        short_number(sum(totals.values())),
        "",
        style="bold",
    )
    return table


# -- dead jobs ----------------------------------------------------------------------------


def failed_at(job: JobView) -> int | None:
    """When the job went dead: its finish time, else the time of its last error."""
    if job.finished_at is not None:
        return job.finished_at
    return job.errors[-1].at if job.errors else None


def dead_table(page: DeadPage) -> Table:
    """One row per dead job: id, queue, attempts, last error (first line, truncated) and
    when it failed. The caption gives the cursor of the next page, if there is one."""
    caption = None
    if page.next_cursor is not None:
        caption = f"more dead jobs: --cursor {page.next_cursor}"
    table = Table(title="Dead jobs", caption=caption, caption_justify="left")
    # Every column but the error keeps its full width; the error takes what is left.
    longest_queue = max((len(job.queue) for job in page.jobs), default=5)
    table.add_column("id", no_wrap=True, min_width=JOB_ID_CHARS)
    table.add_column("queue", no_wrap=True, min_width=min(longest_queue, QUEUE_CHARS))
    table.add_column("attempts", justify="right", no_wrap=True, min_width=8)
    table.add_column("last error", style="red")
    table.add_column("failed at (UTC)", no_wrap=True, min_width=19)
    for job in page.jobs:
        table.add_row(
            job.job_id,
            job.queue,
            f"{job.attempt}/{job.max_attempts}",
            # A wrappable column (so that it alone gives way when the table is too wide)
            # holding text that does not wrap: it is cut with "…" instead.
            Text(truncate(job.last_error), no_wrap=True, overflow="ellipsis"),
            format_time(failed_at(job), millis=False).removesuffix(" UTC"),
        )
    if not page.jobs:
        table.add_row(Text("no dead jobs", style="dim"), "", "", "", "")
    return table


# -- one job ------------------------------------------------------------------------------

# The timing fields of a job, in the order they happen.
_TIMES = (
    ("created", "created_at"),
    ("run at", "run_at"),
    ("ready at", "ready_at"),
    ("lease expires", "lease_expires_at"),
    ("finished", "finished_at"),
)


def _time_cell(ms: int) -> Text:
    text = Text(format_time(ms))
    text.append(f"  ({ms})", style="dim")
    return text


def _json(value: Any) -> RenderableType:
    try:
        return JSON.from_data(value, indent=2)
    except (TypeError, ValueError):
        return Text(repr(value))


def job_panel(job: JobView) -> Panel:
    """Everything ``inspect`` knows of a job: state, queue, priority, attempts, timings (UTC
    and raw ms), worker, last error, the error history, the payload and the result."""
    fields = Table.grid(padding=(0, 2))
    fields.add_column(style="bold", no_wrap=True)
    fields.add_column()
    fields.add_row("state", state_text(job.state))
    fields.add_row("queue", job.queue)
    fields.add_row("priority", priority_text(job.priority))
    fields.add_row("attempts", f"{job.attempt} of {job.max_attempts}")
    for label, name in _TIMES:
        ms = getattr(job, name)
        if ms is not None:
            fields.add_row(label, _time_cell(ms))
    if job.finished_at is not None:
        fields.add_row("total time", format_duration(max(0, job.finished_at - job.created_at)))
    if job.worker_id is not None:
        fields.add_row("worker", job.worker_id)
    if job.idempotency_key is not None:
        fields.add_row("idempotency key", job.idempotency_key)
    if job.last_error is not None:
        fields.add_row("last error", Text(job.last_error, style="red"))

    parts: list[RenderableType] = [fields]
    if job.errors:
        errors = Table(title="errors", title_justify="left", expand=True)
        errors.add_column("attempt", justify="right", no_wrap=True)
        errors.add_column("at (UTC)", no_wrap=True)
        errors.add_column("error", style="red", ratio=1)
        for entry in job.errors:
            errors.add_row(str(entry.attempt), format_time(entry.at).removesuffix(" UTC"),
                           entry.error)  # fmt: skip
        parts += [Text(), errors]
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
    )


# -- demo progress ------------------------------------------------------------------------


def state_progress(console: Console | None = None) -> tuple[Progress, dict[str, TaskID]]:
    """A progress display with one bar per job state (all jobs as the total), and the task
    of each state. Feed it with ``update_state_progress``."""
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
