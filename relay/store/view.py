"""``QueueView``: the per-queue counts as of the last commit, which the writer thread
publishes and any thread reads without a query or a wait.

The store moves its counts while a transaction runs (relay/store/counts.py); only after
its commit does it ``put`` each queue it touched here. So this view never shows what was
rolled back, and reading it never touches the database nor goes through the writer: a
``stats`` request and a ``/metrics`` scrape read a bounded page of it in the trio thread
(relay/server/requests/dispatch.py, relay/server/http/metrics.py), whatever the number of queues.

Sharing between threads rests on the GIL (as relay/store/writer.py's counters do): each
queue's entry is one immutable tuple, replaced whole, so a reader sees one queue's counts
as of one commit; the sorted names change one ``insort`` or ``del`` at a time. A reader
that needs several entries of one moment (the ``_other`` sums of /metrics) checks
``version``, which the writer makes odd while it publishes, and reads again if it moved.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable, Mapping

from relay.protocol.model import JobState, Rate

# Events counted per queue for metrics (relay_jobs_<event>_total, relay_leases_expired_total).
EVENTS = ("submitted", "leased", "acked", "failed", "retried", "dead", "expired", "cancelled")

# The order of an entry's fields: the job counts per state, then the event totals.
STATES = tuple(str(state) for state in JobState)
ENTRY_FIELDS = len(STATES) + len(EVENTS)

# A page taken while the writer publishes is read again, at most this many times; after
# that it is used as read (each queue's entry is still one commit's, and sums derived from
# several entries are clamped at zero by their reader).
READ_ATTEMPTS = 4

Entry = tuple[int, ...]  # STATES counts, then EVENTS totals
# A queue's limits: its max_leased and its rate (either None: not set; not both).
Limits = tuple[int | None, Rate | None]

# A queue's counts as a stats reply gives them, ``"name":{"pending":0,...}``, made as it is
# published (queue names need no JSON escaping: [A-Za-z0-9._:-]): a page of 1,000 queues is
# then one join, ~0.1 ms, where building and encoding their dicts took ~5 ms of the event
# loop per stats request.
_FRAGMENT = ('"%s":{' + ",".join(f'"{state}":%d' for state in STATES) + "}").encode()
_READY = STATES.index("ready")
_N_STATES = len(STATES)


def counts_json(queue: str, entry: Entry | None) -> bytes:
    """``"queue":{"pending":..}`` of a stats reply (``entry`` None: all zeros)."""
    return _FRAGMENT % (queue.encode(), *(entry or (0,) * len(STATES))[: len(STATES)])


class QueueView:
    """Queue name -> its ``Entry``, for the queues that hold jobs, in name order.

    Written by one thread (the writer's, through the store); read by any.
    """

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._json: dict[str, bytes] = {}  # queue -> counts_json(queue, its entry)
        self._names: list[str] = []  # sorted: pages by name, bisect for the cursor
        self._sums: Entry = (0,) * ENTRY_FIELDS  # over every queue
        self.version = 0  # odd while the writer publishes
        # The queues paused as of the last commit (held jobs or not): one frozenset,
        # replaced whole by the writer thread (``publish_paused``).
        self.paused: frozenset[str] = frozenset()
        # The queues with a limit as of the last commit -> their limits (for /metrics):
        # one mapping, replaced whole with ``paused``, at most MAX_QUEUE_SETTINGS long.
        self.limits: Mapping[str, Limits] = {}

    # -- the writer thread ------------------------------------------------------------------

    def publish(self, entries: Iterable[tuple[str, Entry | None]]) -> None:
        """Set each queue's entry (None: it holds no jobs now, and leaves the view)."""
        # (This runs in the writer thread after every commit, per queue it touched: the
        # sums are updated with map, not a loop per field.)
        self.version += 1
        try:
            sums, all_entries, texts = self._sums, self._entries, self._json
            for queue, entry in entries:
                old = all_entries.get(queue)
                if old is not None:
                    sums = tuple(map(operator.sub, sums, old))
                if entry is None:
                    if old is not None:
                        del all_entries[queue]
                        del texts[queue]
                        del self._names[bisect.bisect_left(self._names, queue)]
                    continue
                sums = tuple(map(operator.add, sums, entry))
                texts[queue] = _FRAGMENT % (queue.encode(), *entry[:_N_STATES])
                all_entries[queue] = entry
                if old is None:
                    bisect.insort(self._names, queue)
            self._sums = sums
        finally:
            self.version += 1

    def publish_paused(
        self, paused: frozenset[str], limits: Mapping[str, Limits] | None = None
    ) -> None:
        """Set the queues paused (all of them, as committed), and with ``limits`` the
        queues that have a limit (all of them) with their limits."""
        self.paused = paused
        if limits is not None:
            self.limits = limits

    def names_between(self, after: str | None, last: str | None) -> list[str]:
        """The queues named after ``after`` (None: from the first) up to ``last``
        included (None: to the end)."""
        names = self._names
        start = 0 if after is None else bisect.bisect_right(names, after)
        end = len(names) if last is None else bisect.bisect_right(names, last)
        return names[start:end]

    # -- any thread -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, queue: object) -> bool:
        return queue in self._entries

    def get(self, queue: str) -> Entry | None:
        return self._entries.get(queue)

    def page(
        self, after: str | None, limit: int, only: Iterable[str] | None = None
    ) -> tuple[list[tuple[str, Entry | None]], str | None]:
        """Up to ``limit`` queues named after ``after``, in name order, with their entries,
        and the name to pass as ``after`` for the next page (None: this is the last). Of
        the queues that hold jobs; with ``only``, of those names, each with its entry or
        None if it holds no jobs. Costs O(limit), and O(log n) to find ``after``."""
        for _ in range(READ_ATTEMPTS):
            version = self.version
            rows, next_after = self._page(after, limit, only)
            if version == self.version and not version & 1:
                break
        return rows, next_after

    def _page(
        self, after: str | None, limit: int, only: Iterable[str] | None
    ) -> tuple[list[tuple[str, Entry | None]], str | None]:
        if only is not None:
            names = sorted(set(only))
            start = 0 if after is None else bisect.bisect_right(names, after)
            chosen = names[start : start + limit + 1]
        else:
            names = self._names
            start = 0 if after is None else bisect.bisect_right(names, after)
            chosen = names[start : start + limit + 1]  # (one slice: one step under the GIL)
        more = len(chosen) > limit
        chosen = chosen[:limit]
        entries = self._entries
        rows = [(queue, entries.get(queue)) for queue in chosen]
        return rows, chosen[-1] if more else None

    def page_json(
        self, after: str | None, limit: int, only: Iterable[str] | None = None
    ) -> tuple[bytes, list[str], str | None, list[str]]:
        """``page``, as a stats reply's ``queues`` object (JSON), the page's queues that
        have ready jobs, the next ``after``, and the page's queues that are paused."""
        for _ in range(READ_ATTEMPTS):
            version = self.version
            rows, next_after = self._page(after, limit, only)
            texts = self._json
            parts = [texts.get(queue) or counts_json(queue, None) for queue, _ in rows]
            paused = self.paused
            if version == self.version and not version & 1:
                break
        ready = [queue for queue, entry in rows if entry is not None and entry[_READY]]
        stopped = [queue for queue, _ in rows if queue in paused] if paused else []
        return b"{" + b",".join(parts) + b"}", ready, next_after, stopped

    def top(self, limit: int) -> tuple[list[tuple[str, Entry]], Entry]:
        """The first ``limit`` queues by name with their entries, and the sums of the
        entries of every queue, read at one moment (unless the writer kept publishing
        through READ_ATTEMPTS reads)."""
        for _ in range(READ_ATTEMPTS):
            version = self.version
            rows = [(q, e) for q, e in self._page(None, limit, None)[0] if e is not None]
            sums = self._sums
            if version == self.version and not version & 1:
                break
        return rows, sums
