"""Request durations per op: one histogram each, on trio's clock.

The trio thread keeps the durations of what it answers (``Dispatcher``), the writer
thread those of the replies it writes itself (``AnsweredNow``, for
relay/server/connections/direct.py); each is observed by its one thread, and ``statistics``
merges the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import itemgetter
from typing import Any

import trio

from relay.store.items import Item
from relay.util.histogram import Histogram, HistogramSnapshot

_ITEM = itemgetter(0)  # (of a pair: its item)


class Durations:
    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = tuple(bounds)
        self._by_op: dict[str, Histogram] = {}

    def histogram(self, op: str) -> Histogram:
        histogram = self._by_op.get(op)
        if histogram is None:
            histogram = self._by_op[op] = Histogram(self._bounds)
        return histogram

    def observe_runs(self, items: Iterable[Item], now: float) -> None:
        """``items`` were answered at ``now``: one observation per run of items of one op
        that arrived together (the lines of one read, say)."""
        op, started, n = None, 0.0, 0
        for item in items:
            if item[0] is op and item[3] == started:
                n += 1
                continue
            if n:
                self.histogram(op.name).observe(now - started, n)
            op, started, n = item[0], item[3], 1
        if n:
            self.histogram(op.name).observe(now - started, n)

    def snapshots(self) -> dict[str, HistogramSnapshot]:
        """op -> snapshot (safe while the observing thread adds an op: a copy is read)."""
        return {op: histogram.snapshot() for op, histogram in list(self._by_op.items())}


class AnsweredNow:
    """The requests the writer thread answered itself, on every connection, counted by it
    alone (the dispatcher's): how many, and their durations per op on trio's clock."""

    def __init__(self, clock: trio.abc.Clock, bounds: Sequence[float]) -> None:
        self.count = 0
        self._clock = clock  # (its current_time may be read from any thread)
        self._durations = Durations(bounds)

    def answered(self, pairs: list[tuple[Item, Any]]) -> None:
        """Writer thread: count these out, and time them (``Durations.observe_runs``)."""
        self.count += len(pairs)
        self._durations.observe_runs(map(_ITEM, pairs), self._clock.current_time())

    def durations(self, others: dict[str, HistogramSnapshot]) -> dict[str, HistogramSnapshot]:
        """Trio thread: ``others`` (the trio thread's durations) with these added in."""
        for op, mine in self._durations.snapshots().items():
            others[op] = others[op].merged(mine) if op in others else mine
        return others
