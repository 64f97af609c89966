"""A small cumulative histogram for statistics() snapshots.

Core code records observations here; only relay/server/metrics.py turns snapshots into
Prometheus text, so nothing else imports prometheus_client.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs


@attrs.frozen
class HistogramSnapshot:
    """Cumulative counts per upper bound (``counts[i]`` observations <= ``bounds[i]``)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    total: float


class Histogram:
    """Not thread-safe: observe and snapshot from one thread (the trio thread here)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._buckets = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.count = 0
        self.total = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """Count ``n`` observations of ``value``."""
        self.count += n
        self.total += value * n
        self._buckets[bisect.bisect_left(self.bounds, value)] += n

    def snapshot(self) -> HistogramSnapshot:
        cumulative, running = [], 0
        for n in self._buckets[:-1]:
            running += n
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), self.count, self.total)
