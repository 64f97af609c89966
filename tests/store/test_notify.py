"""Commits as notifications for the other servers (relay/store/postgres/notify.py)."""

from __future__ import annotations

from relay.store.base import Changes
from relay.store.postgres import notify


def test_a_notification_carries_how_many_jobs_each_queue_got():
    """Another server's parked long-polls wake as many as the jobs made ready."""
    changes = Changes()
    changes.made_ready("a", 3)
    changes.made_ready("b")
    text = notify.payload("one", changes)
    assert text is not None
    heard = notify.parse(text, "two")
    assert isinstance(heard, Changes)
    assert heard.ready_queues == {"a", "b"}
    assert heard.ready_counts == {"a": 3, "b": 1}


def test_a_notification_without_counts_counts_one_job_per_queue():
    """As an older server sends it; and counts that are not counts count as one."""
    heard = notify.parse('{"o": "old", "q": ["a", "b", "c"], "n": [2, "x"]}', "new")
    assert isinstance(heard, Changes)
    assert heard.ready_counts == {"a": 2, "b": 1, "c": 1}
    heard = notify.parse('{"o": "old", "q": ["a"], "n": {"a": 5}}', "new")
    assert isinstance(heard, Changes) and heard.ready_counts == {"a": 1}


def test_a_schedules_next_slot_alone_is_notified_and_read_back():
    changes = Changes()
    changes.schedule(1_234)
    text = notify.payload("me", changes)
    assert text is not None
    back = notify.parse(text, "other")
    assert isinstance(back, Changes) and back.next_schedule_at == 1_234
    assert notify.payload("me", Changes()) is None
