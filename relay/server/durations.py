"""Request durations per op: one histogram each, on trio's clock.

The trio thread keeps the durations of what it answers (``Dispatcher``), the writer
thread those of the replies it writes itself (``AnsweredNow``, relay/server/direct.py);
each is observed by its one thread, and ``statistics`` merges the two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from relay.histogram import Histogram, HistogramSnapshot
from relay.store.items import Item


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
