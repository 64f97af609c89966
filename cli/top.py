"""``relay-trio top``: a live view of the queues, fed by ``watch`` and a ``stats`` a second.

``TopView`` holds what is shown and knows nothing of sockets: the events and stats given
to it, and ``render()``, so that a test can draw it into a recording Console. ``run_top``
owns the connection: it reconnects after a server restart (showing that it does), and
draws at most ``REFRESH_PER_S`` times a second. An error that no retry can fix (a token
refused, TLS on one side only or a certificate not trusted, a peer that is not a relay-trio
server) ends it instead, for the command to say in one line. The view is laid out for the
terminal's width as the other tables are (cli/views.py): one line per queue and per
failure.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import trio
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from relay.client.client import Client, WorkersPage, open_client
from relay.client.tcp import tls_refused
from relay.protocol.errors import BadRequest, RelayError, Unauthorized, UnknownOp, WrongServer
from relay.protocol.model import JobState
from relay_cli import calls, views
from relay_cli.errors import _leaves, _reason
from relay_cli.ids import server_short_ids
from relay_cli.queue import limited_queues

RATE_WINDOW_S = 10.0  # rates are per second over this many seconds
STATS_EVERY_S = 1.0
REFRESH_PER_S = 4
FAILURES_SHOWN = 8
RECONNECT_S = 1.0
STATES = [str(state) for state in JobState]
# The throughput's sparkline per queue: jobs succeeded per SPARK_STEP_S, the last
# SPARK_STEPS steps (5 minutes), counted from the events as they come (so it starts empty
# when top starts), one character a step, the step under way left out.
SPARK_STEP_S = 10.0
SPARK_STEPS = 30
# Shown for whole minutes, 2 at least (the header, "ok/10s, 2m", fits 12 cells); from
# SPARK_WIDE columns on, the pending and succeeded counts make way for it if they must.
SPARK_MINUTE = 6  # steps
SPARK_MIN = 2 * SPARK_MINUTE
SPARK_WIDE = 120
# (Drawn by views.sparkline: a step without a job "·", a step before top started a space.)
# The workers panel: one workers_list (the server's connected workers) every
# WORKERS_EVERY_S, as it reads the leased jobs' index each time; its first page of up to
# WORKERS_ASKED (the op's most), of which WORKERS_SHOWN rows, the most jobs held first.
WORKERS_EVERY_S = 2.0
WORKERS_ASKED = 100
WORKERS_SHOWN = 8
# The text columns of the panel (address and client from WORKERS_WIDE columns on) get
# their longest cell where it fits, else a share of the room (WORKER_TEXT_MIN at least).
WORKERS_WIDE = 120
WORKER_TEXT_MIN = 8
NO_WORKERS = "no worker connected"
# (Each server lists its own workers: on PostgreSQL, a worker of another server may serve it.)
UNSERVED = "ready jobs and no worker on this server: "


# The rates, by the kind of event counted, with their columns' headers.
RATES = (("submitted", "sub/s"), ("succeeded", "ok/s"), ("failed", "fail/s"))
# The counts left out when the queue names would not fit whole beside them: the rates of
# submitted and succeeded jobs stay, and ``relay-trio stats`` shows every count.
OPTIONAL_STATES = ("pending", "succeeded", "cancelled")
NO_FAILURES = "none yet"


class TopView:
    """What ``top`` shows: per queue, the counts by state (from stats) and the rates of
    submitted, succeeded and failed jobs over the last RATE_WINDOW_S (from events); the
    latest failures; and the connection's status.

    Drawn as two tables, one line per row, at the width of the terminal:

    - per queue (its name marked "paused" and "limited" as ``views.queue_cell`` marks
      them: which have a limit, ``limits``, from a queue_list after each stats): the
      jobs in each state, how long its oldest ready job has waited, and
      the jobs submitted, succeeded and failed per second ("sub/s", "ok/s", "fail/s").
      The pending and succeeded counts are left out where they would cut a queue name:
      at 80 columns, a name longer than 3 to 9 characters (as the counts and rates have
      six figures or one); at 100, longer than 23 to 29. The other columns then leave a
      name 21 to 27 characters at 80; a longer one is cut in the middle
      (``views.cut_middle``): "billing.in…nightly-run". Last, where the names fit whole
      beside it, a sparkline per queue of the jobs succeeded in each 10 s of the last
      minutes (``throughput``: counted from the events since top started; the steps
      before are blank), 2 to 5 whole minutes of it: none at 80 columns unless the names
      are short, 4 minutes at 120 beside a 40-character name (where the pending and
      succeeded counts make way for it), 5 at 200.
    - the server's connected workers (``workers``, from a workers_list every
      WORKERS_EVERY_S; no panel from a server without the op): the most jobs held first,
      WORKERS_SHOWN of them, with the queues each asks for, the jobs it holds, the longest
      held and how long since its last request (client and address from WORKERS_WIDE
      columns); and under them the queues with ready jobs that no worker asks for.
    - the latest failures: the job's id (as the server abbreviates it, unique among all
      its jobs: ``short``, asked for as each failure comes and again with each stats;
      from a server without ``short_ids``, the shortest abbreviation unique among the
      failures shown, ``views.short_ids``; whole with ``full_ids``), its queue, the
      attempt and the first line of its error, which gets the rest of the width.
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, full_ids: bool = False
    ) -> None:
        self.clock = clock
        self.full_ids = full_ids
        self.queues: dict[str, dict[str, int]] = {}
        self.oldest_ready_ms: dict[str, int] = {}  # per queue with ready jobs
        self.server: Any = None  # the stats' ServerInfo
        # (when, queue, kind): kind is submitted, succeeded or failed.
        self.recent: collections.deque[tuple[float, str, str]] = collections.deque()
        self.failures: collections.deque[tuple[str, str, int, str]] = collections.deque(
            maxlen=FAILURES_SHOWN
        )
        self.short: dict[str, str] = {}  # the failures' ids as the server abbreviates them
        self.lagged = 0
        self.status = "connecting"
        self.total_queues: int | None = None  # more queues than the stats page listed
        self.paused: frozenset[str] = frozenset()  # the stats page's paused queues
        self.limited: frozenset[str] = frozenset()  # and those with a limit (``limits``)
        # queue -> step (clock // SPARK_STEP_S) -> jobs succeeded in it, the last steps
        self.done: dict[str, dict[int, int]] = {}
        self.started = clock()
        self.counting_since = self.started  # the events' watch began (``watching``)
        # The server's connected workers (``workers``); None: not known, or a server
        # without workers_list: no panel.
        self.connected: _Workers | None = None

    def stats(
        self,
        queues: dict[str, dict[str, int]],
        server: Any,
        oldest_ready_ms: dict[str, int],
        total_queues: int | None = None,
        paused: Iterable[str] = (),
    ) -> None:
        """The counts of a stats reply: of its first page of queues, of ``total_queues``
        (None: all of them); which of them are ``paused``."""
        self.queues, self.server, self.oldest_ready_ms = queues, server, oldest_ready_ms
        self.total_queues = total_queues
        self.paused = frozenset(paused)

    def limits(self, limited: Iterable[str]) -> None:
        """The stats page's queues that have a limit (max_leased or rate), marked so."""
        self.limited = frozenset(limited)

    def workers(self, page: WorkersPage | None) -> None:
        """A workers_list page (its first: docs/protocol.md, Workers), or None for a server
        without the op: the panel is hidden."""
        if page is None:
            self.connected = None
            return
        rows = [
            _Worker(w.worker_id, w.client, w.peer, tuple(w.queues), w.queues_total,
                    w.jobs_held, w.longest_held_ms, max(0, page.at - w.last_request_at),
                    w.parked)
            for w in page.workers
        ]  # fmt: skip
        whole = page.total == len(rows) and all(len(w.queues) >= w.queues_total for w in rows)
        self.connected = _Workers(page.server, tuple(rows), page.total, whole)

    def event(self, event: dict[str, Any]) -> str | None:
        """Count one event; returns the job id of a failure (whose error to fetch)."""
        if event.get("event") == "lagged":
            self.lagged += int(event.get("dropped") or 0)
            return None
        state = event.get("state")
        kind = None
        if state in ("ready", "pending") and "from" not in event:  # a job just made
            kind = "submitted"
        elif state == "succeeded":
            kind = "succeeded"
        elif state in ("retrying", "dead"):
            kind = "failed"
        if kind is None:
            return None
        now = self.clock()
        self.recent.append((now, event["queue"], kind))
        if kind == "succeeded":
            steps = self.done.setdefault(event["queue"], {})
            step = int(now // SPARK_STEP_S)
            steps[step] = steps.get(step, 0) + 1
        return event["job_id"] if kind == "failed" else None

    def failure(self, job_id: str, queue: str, attempt: int, error: str) -> None:
        self.failures.appendleft((job_id, queue, attempt, error))

    def failure_ids(self) -> list[str]:
        return [job_id for job_id, *_ in self.failures]

    def shorten(self, short: Mapping[str, str]) -> None:
        """The server's abbreviations of failures' ids (cli/ids.py), kept for those shown."""
        shown = set(self.failure_ids())
        self.short = {k: v for k, v in {**self.short, **short}.items() if k in shown}

    def watching(self) -> None:
        """A watch of the events begins (at start, and again after a reconnect, when the
        events in between are lost): the rates count afresh from now."""
        self.counting_since = self.clock()
        self.recent.clear()

    def rates(self) -> dict[str, dict[str, float]]:
        """Per queue: submitted, succeeded and failed per second over the window, or over
        the time the events have been watched while that is shorter (a second at least):
        in the first seconds a rate is not divided by time it did not watch."""
        now = self.clock()
        horizon = now - RATE_WINDOW_S
        while self.recent and self.recent[0][0] < horizon:
            self.recent.popleft()
        counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for _, queue, kind in self.recent:
            counts[queue][kind] += 1
        window = min(RATE_WINDOW_S, max(1.0, now - self.counting_since))
        return {q: {k: n / window for k, n in c.items()} for q, c in counts.items()}

    def throughput(self, queues: Iterable[str]) -> dict[str, list[int | None]]:
        """Per queue of ``queues``: the jobs succeeded in each of the last SPARK_STEPS whole
        steps, oldest first (None for a step that ended before top started). Steps older
        are forgotten here, and the queues without any left: the memory is SPARK_STEPS
        numbers per queue at most."""
        now = int(self.clock() // SPARK_STEP_S)
        first = now - SPARK_STEPS
        since = int(self.started // SPARK_STEP_S)
        for queue, steps in list(self.done.items()):
            for step in [step for step in steps if step < first]:
                del steps[step]
            if not steps:
                del self.done[queue]
        return {
            queue: [self.done.get(queue, {}).get(step, 0) if step >= since else None
                    for step in range(first, now)]
            for queue in queues
        }  # fmt: skip

    def render(self) -> views.Fitted:
        """The view as it is now, laid out at the width it is drawn at. What it shows is
        taken here, in the caller's thread: a Live redraws it from a thread of its own
        while events go on changing the view."""
        rates = self.rates()
        names = sorted(set(self.queues) | set(rates))
        done = self.throughput(names)
        rows = [
            _QueueRow(name, dict(self.queues.get(name, {})), self.oldest_ready_ms.get(name),
                      rates.get(name, {}), name in self.paused, name in self.limited,
                      done[name])
            for name in names
        ]  # fmt: skip
        status = Text(f"relay-trio top · {self.status}", style="bold", no_wrap=True,
                      overflow="ellipsis")  # fmt: skip
        if self.server is not None:
            connections = self.server.connections
            status.append(f" · {connections} connection" + ("" if connections == 1 else "s"))
        if self.total_queues is not None:
            status.append(f" · first {len(self.queues)} of {self.total_queues} queues")
        if self.lagged:
            status.append(f" · {self.lagged} events lost to lag", style="yellow")
        layout = functools.partial(_layout, status, rows, list(self.failures), self.full_ids,
                                   dict(self.short), self.connected)  # fmt: skip
        return views.Fitted(layout)


class _QueueRow(NamedTuple):
    name: str
    counts: dict[str, int]
    oldest_ready_ms: int | None
    rates: dict[str, float]
    paused: bool = False
    limited: bool = False
    done: Sequence[int | None] = ()  # jobs succeeded per SPARK_STEP_S (``throughput``)


class _Worker(NamedTuple):
    worker_id: str
    client: str | None
    peer: str
    queues: tuple[str, ...]  # the first 32 it asks for
    queues_total: int
    jobs_held: int
    longest_held_ms: int | None  # None: since when not known (leased before a reconnect)
    idle_ms: int  # since its last request, when the server made the page
    parked: int  # long-polls waiting now


class _Workers(NamedTuple):
    server: str
    rows: tuple[_Worker, ...]
    total: int
    whole: bool  # every worker, with every queue it asks for: no queue is missed


def _layout(
    status: Text,
    rows: Sequence[_QueueRow],
    failures: Sequence[tuple[str, str, int, str]],
    full_ids: bool,
    short: Mapping[str, str],
    workers: _Workers | None,
    width: int,
) -> Group:
    parts: list[Any] = [status, _queues_table(rows, width)]
    if workers is not None:
        parts.append(_workers_table(workers, _unserved(rows, workers), width))
    parts.append(_failures_table(failures, full_ids, short, width))
    return Group(*parts)


def _unserved(rows: Sequence[_QueueRow], workers: _Workers) -> list[str]:
    """The queues with ready jobs, not paused, that no worker connected to this server
    asks for: stuck, not slow. None where the page is not whole (a worker's queues may be
    missing from it)."""
    if not workers.whole:
        return []
    asked = {queue for worker in workers.rows for queue in worker.queues}
    return [row.name for row in rows
            if row.counts.get("ready") and not row.paused and row.name not in asked]  # fmt: skip


def _workers_table(workers: _Workers, unserved: Sequence[str], width: int) -> Group:
    """The server's connected workers, the most jobs held first, WORKERS_SHOWN at most:
    worker id, (from WORKERS_WIDE columns) client and address, the queues it asks for,
    the jobs it holds, the longest it has held one ("?": not known), and how long since
    its last request ("*": a long-poll waiting). Under it, how many are not shown, and
    the queues with ready jobs that no worker asks for."""
    shown = sorted(workers.rows, key=lambda w: -w.jobs_held)[:WORKERS_SHOWN]
    texts: dict[str, list[str]] = {"worker": [views.printable(w.worker_id) for w in shown]}
    if width >= WORKERS_WIDE:
        texts["client"] = [views.printable(w.client or "-") for w in shown]
        texts["address"] = [w.peer for w in shown]
    texts["queues"] = [",".join(w.queues) + (f" +{w.queues_total - len(w.queues)}"
                                             if w.queues_total > len(w.queues) else "")
                       for w in shown]  # fmt: skip
    numbers = {
        "jobs": [views.short_number(w.jobs_held) for w in shown],
        "longest\nheld": ["-" if not w.jobs_held else "?" if w.longest_held_ms is None
                          else views.short_duration(w.longest_held_ms) for w in shown],
        "idle": [views.short_duration(w.idle_ms) + (" *" if w.parked else "") for w in shown],
    }  # fmt: skip
    fixed = [views.column_width(header, cells) for header, cells in numbers.items()]
    room = width - views.tables_width([0] * len(texts) + fixed)
    wants = {name: views.column_width(name, cells) for name, cells in texts.items()}
    widths = dict(wants)
    if sum(wants.values()) > room:  # each its share, the room a short one leaves to others
        left, names = room, sorted(wants, key=wants.get)  # type: ignore[arg-type]
        for n, name in enumerate(names):
            widths[name] = max(min(wants[name], left // (len(names) - n)), WORKER_TEXT_MIN)
            left -= widths[name]

    title = f"Workers of {workers.server}" if workers.server else "Workers"
    table = views.plain_table(title)
    for name in texts:
        table.add_column(name, width=widths[name], no_wrap=True)
    for (header, _), w in zip(numbers.items(), fixed, strict=True):
        table.add_column(header, width=w, justify="right", no_wrap=True)
    for n in range(len(shown)):
        # (Text, not str: a client's name or an address like "[::1]:5" is no markup)
        table.add_row(*(Text(views.cut_middle(cells[n], widths[name]))
                        for name, cells in texts.items()),
                      *(Text(cells[n]) for cells in numbers.values()))  # fmt: skip
    notes: list[Any] = [table]
    if not shown:
        notes = [Text(title, style="table.title"), Text(NO_WORKERS, style="dim")]
    if workers.total > len(shown):
        notes.append(Text(f"{len(shown)} of {workers.total} workers, the most jobs held first",
                          style="table.caption"))  # fmt: skip
    if unserved:  # (a line of its own: as wide as the terminal, not the table)
        notes.append(Text(UNSERVED + ", ".join(unserved), style="bold red"))
    return Group(*notes)


def _queues_table(rows: Sequence[_QueueRow], width: int) -> Table:
    totals = {state: sum(row.counts.get(state, 0) for row in rows) for state in STATES}
    columns: dict[str, list[Text]] = {
        state: [views.count_text(row.counts.get(state, 0), state) for row in rows]
        for state in views.shown_states(totals)
    }
    columns[views.OLDEST_READY] = [Text(age(row.oldest_ready_ms)) for row in rows]
    for kind, header in RATES:
        columns[header] = [Text(rate(row.rates.get(kind, 0.0))) for row in rows]
    widths = {header: views.column_width(header, cells) for header, cells in columns.items()}
    widths[views.OLDEST_READY] += 1  # "2m 03s" has a space: one more before it

    names = ["queue", *(views.marked(row.name, row.paused, row.limited) for row in rows)]
    longest = max(map(len, names))

    def room() -> int:  # for the queue names, beside the other columns
        return width - views.tables_width([0, *widths.values()], views.NUMBERS_GAP)

    # The throughput's sparkline where the names fit whole beside it; from SPARK_WIDE
    # columns on, before the optional counts.
    spark = spark_steps(room() - longest)
    if longest > room() or (spark is None and width >= SPARK_WIDE and rows):
        for state in OPTIONAL_STATES:
            if state in columns:
                del columns[state], widths[state]
        spark = spark_steps(room() - longest)
    if spark is not None and rows:
        header = f"ok/{SPARK_STEP_S:.0f}s, {spark * SPARK_STEP_S / 60:.0f}m"
        columns[header] = [Text(views.sparkline(row.done[-spark:]), style="green") for row in rows]
        widths[header] = spark + views.NUMBERS_GAP  # (one more cell before it)
    queue = views.queue_width(names, room())

    table = views.plain_table("Queues", gap=views.NUMBERS_GAP)
    table.add_column("queue", width=queue, no_wrap=True)
    for header, column in widths.items():
        table.add_column(header, justify="right", width=column, no_wrap=True,
                         header_style=views.STATE_STYLES.get(header, ""))  # fmt: skip
    for n, row in enumerate(rows):
        table.add_row(views.queue_cell(row.name, row.paused, queue, row.limited),
                      *(cells[n] for cells in columns.values()))  # fmt: skip
    table.caption = views.paused_caption([row.name for row in rows if row.paused], queue,
                                         [row.name for row in rows if row.limited])  # fmt: skip
    table.caption_justify = "left"
    return table


def _failures_table(
    failures: Sequence[tuple[str, str, int, str]],
    full_ids: bool,
    short: Mapping[str, str],
    width: int,
) -> Table:
    job_ids = [job_id for job_id, *_ in failures]
    ids = {job_id: job_id for job_id in job_ids} if full_ids else views.short_ids(job_ids, short)
    attempts = [str(attempt) for _, _, attempt, _ in failures]
    errors = [views.truncate(error) for *_, error in failures]
    fixed = [views.column_width("job", [*ids.values(), NO_FAILURES]),
             views.column_width("attempt", attempts)]  # fmt: skip
    queue, error = views.share_room(width - views.tables_width([*fixed, 0, 0]),
                                    ["queue", *(queue for _, queue, _, _ in failures)],
                                    ["error", *errors])  # fmt: skip
    table = views.plain_table("Latest failures")
    table.add_column("job", width=fixed[0], no_wrap=True)
    table.add_column("queue", width=queue, no_wrap=True)
    table.add_column("attempt", width=fixed[1], no_wrap=True, justify="right")
    table.add_column("error", width=error, no_wrap=True, style="red")
    for (job_id, name, _, _), attempt, text in zip(failures, attempts, errors, strict=True):
        table.add_row(
            ids[job_id], views.cut_middle(name, queue), attempt, Text(views.truncate(text, error))
        )  # fmt: skip (a worker's text: no markup)
    if not failures:
        table.add_row(Text(NO_FAILURES, style="dim"), "", "", "")
    return table


def spark_steps(room: int) -> int | None:
    """How many steps of the sparkline to show in ``room`` cells (a column of them and
    its gap, and one more cell before it), whole minutes of them; None if not SPARK_MIN."""
    steps = min(SPARK_STEPS, room - 2 * views.NUMBERS_GAP) // SPARK_MINUTE * SPARK_MINUTE
    return steps if steps >= SPARK_MIN else None


def age(ms: int | None) -> str:
    """How long the oldest ready job has waited ("2m 03s", "1h 02m"); "-" for a queue with
    none ready."""
    return "-" if ms is None else views.short_duration(ms)


def rate(per_s: float) -> str:
    """Jobs per second: "0.5", "123.4", then whole ("1234"), and "1.23M" past a million."""
    return f"{per_s:.1f}" if per_s < 1000 else views.short_number(round(per_s))


async def run_top(
    address: str, token: str | None, tls_ca: str | None, view: TopView, connect_timeout: float
) -> None:
    """Show the view until cancelled (Ctrl-C), reconnecting whenever the server goes.
    Raises what ``follow`` cannot retry, once the screen is restored."""
    # (Every command's console: it reads no markup in any text.)
    live = Live(view.render(), refresh_per_second=REFRESH_PER_S, screen=True,
                console=calls.console())  # fmt: skip
    with live:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_redraw, live, view)
            await follow(address, token, tls_ca, view, connect_timeout)
            nursery.cancel_scope.cancel()


async def follow(
    address: str,
    token: str | None,
    tls_ca: str | None,
    view: TopView,
    connect_timeout: float = 10.0,
) -> None:
    """Feed the view until cancelled: connect, follow, and after the connection is lost
    (or cannot be made) say so in the view and try again every RECONNECT_S. Raises the
    first error that trying again cannot fix (see ``incurable``)."""
    connected = False
    view.status = f"connecting to {address}"
    while True:
        try:
            async with open_client(
                address,
                reconnect=False,
                token=token,
                tls_ca=tls_ca,
                connect_timeout=connect_timeout,
            ) as client:
                connected = True
                view.status = f"connected to {address}"
                await _follow(client, view)
        except* (RelayError, OSError, trio.TooSlowError) as lost:  # from any of _follow's tasks
            leaves = list(_leaves(lost))
            for exc in leaves:
                if incurable(exc, connected):
                    raise exc from None
            verb = "reconnecting to" if connected else "connecting to"
            view.status = f"{verb} {address} ({_why(leaves[0])})"
        await trio.sleep(RECONNECT_S)


def incurable(exc: BaseException, connected: bool) -> bool:
    """Whether no retry can fix ``exc``: a token refused (or of a role that may not watch),
    a request refused as malformed, a certificate not trusted or TLS on one side only, a
    peer that is not a relay-trio server. A server that answered before (``connected``) and
    now closes at hello is taken to be restarting, not to have become another kind."""
    if isinstance(exc, Unauthorized | BadRequest) or tls_refused(exc):
        return True
    return isinstance(exc, WrongServer) and not connected


def _why(exc: BaseException) -> str:
    """Why a connection failed or was lost, in a few words for the status line."""
    return exc.message if isinstance(exc, RelayError) else _reason(exc)


async def _redraw(live: Live, view: TopView) -> None:
    while True:
        live.update(view.render())
        await trio.sleep(1 / REFRESH_PER_S)


async def _follow(client: Client, view: TopView) -> None:
    """Feed the view from one connection until it drops (raises)."""
    failed: trio.MemorySendChannel[str]
    failed, failed_out = trio.open_memory_channel[str](FAILURES_SHOWN)

    # The server's abbreviations of the failures' ids, unique among all its jobs when
    # shown: asked for as each failure comes (before it is shown) and with each stats, as
    # jobs made since may share more digits. None once the server says it has no
    # short_ids: the view then shortens them among the failures shown.
    asking = True

    async def short_ids(job_ids: list[str]) -> dict[str, str]:
        nonlocal asking
        if not (asking and job_ids):
            return {}
        short = await server_short_ids(client, job_ids)
        asking = short is not None
        return short or {}

    # Which queues have a limit: a stats reply does not say, so one queue_list of the stats
    # page's queues follows each stats (one request a STATS_EVERY_S, its reply the size of
    # the stats'); no more once the server says it has no queue_list {queues}.
    asking_limits = True

    async def poll_stats() -> None:
        nonlocal asking_limits
        while True:
            stats = await client.stats(oldest_ready=True)
            more = stats.total_queues if stats.next_cursor is not None else None
            view.stats(stats.queues, stats.server, stats.oldest_ready_ms or {}, more, stats.paused)
            if asking_limits:
                limited = await limited_queues(client, stats.queues)
                asking_limits = limited is not None
                view.limits(limited or ())
            view.shorten(await short_ids(view.failure_ids()))
            await trio.sleep(STATS_EVERY_S)

    async def poll_workers() -> None:
        # workers_list is an extension (docs/protocol.md, Workers): a server without it
        # answers unknown_op, and top then shows no panel and asks no more.
        while True:
            try:
                page = await client.workers_list(limit=WORKERS_ASKED)
            except (UnknownOp, Unauthorized):
                view.workers(None)
                return
            view.workers(page)
            await trio.sleep(WORKERS_EVERY_S)

    async def fetch_errors() -> None:
        async for job_id in failed_out:
            job = await client.inspect(job_id)
            short = await short_ids([job.job_id, *view.failure_ids()[: FAILURES_SHOWN - 1]])
            error = views.truncate(job.last_error)
            view.failure(job.job_id, job.queue, job.attempt, error)
            view.shorten(short)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(poll_stats)
        nursery.start_soon(fetch_errors)
        nursery.start_soon(poll_workers)
        view.watching()
        events = client.watch()
        async with events:
            async for event in events:
                job_id = view.event(event)
                if job_id is not None:
                    with contextlib.suppress(trio.WouldBlock):  # more than shown: skip
                        failed.send_nowait(job_id)
