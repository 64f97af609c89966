"""A small cumulative histogram for statistics() snapshots.

Core code records observations here; only relay/server/http/metrics.py turns snapshots into
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

    def merged(self, other: HistogramSnapshot) -> HistogramSnapshot:
        """The snapshot of both histograms' observations together (same bounds)."""
        assert self.bounds == other.bounds
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return HistogramSnapshot(
            self.bounds, counts, self.count + other.count, self.total + other.total
        )


class Histogram:
    """Observed from one thread only. A snapshot may be taken from another: it copies the
    buckets in one step, so its counts always agree with each other (its total may lag
    or lead them by the observation being made)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._buckets = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    @property
    def count(self) -> int:
        return sum(self._buckets)

    def observe(self, value: float, n: int = 1) -> None:
        """Count ``n`` observations of ``value``."""
        self.total += value * n
        self._buckets[bisect.bisect_left(self.bounds, value)] += n

    def snapshot(self) -> HistogramSnapshot:
        buckets = self._buckets.copy()  # (one step: the observing thread cannot interleave)
        cumulative, running = [], 0
        for n in buckets[:-1]:
            running += n
            cumulative.append(running)
        return HistogramSnapshot(self.bounds, tuple(cumulative), sum(buckets), self.total)
