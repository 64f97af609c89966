"""relay/log.py: the summary of events that come in floods."""

from __future__ import annotations

from relay.log import Summary


def test_a_flood_is_logged_once_per_interval_with_its_count():
    summary = Summary(interval=1.0)
    assert summary.count(10.0) == 1  # the first is logged at once
    assert [summary.count(10.0 + i / 10) for i in range(1, 10)] == [0] * 9
    assert summary.count(11.0) == 10  # nine held back, and this one
    assert summary.count(11.5) == 0
    assert summary.count(20.0) == 2
