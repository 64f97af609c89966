"""Commits as notifications, for the other servers: what a commit sends, and how a
notification reads back. Never imports trio (the listening side is relay/server/services/feed.py).

A commit that makes jobs ready, or sets an earlier due time, lease expiry or schedule slot,
also sends one notification (``payload``) on ``CHANNEL``, right after it and only if it
committed (``NOTIFY``); it is lost if the connection is, between the two. One that only
made jobs ready goes only if another server has long-polls parked on one of its queues
(``NOTIFY_IF_WAITED``, waiters.py): most commits of a busy producer then send none. A
notification is a hint, never a state: whoever it wakes claims or passes through its own
writer as always, so one lost or repeated changes nothing but latency.
"""

from __future__ import annotations

import orjson

from relay.store.base import Changes

# A server's row in ``waiters`` for this queue name waits on every queue (queue names are 1
# to 128 characters).
EVERY = ""

CHANNEL = "relay_changes"
# Sent right after the COMMIT of the transaction it tells of, in the same round trip, as a
# transaction of its own (the implicit one of a statement after COMMIT) that does not
# wait for its commit record to reach the disk (``synchronous_commit`` off for it alone:
# the notification is a hint, and the commit it tells of is durable already). Not inside
# that transaction: PostgreSQL serializes the commits of the transactions that notify, on
# one lock per database held until the commit is flushed, so the servers on one database
# could never commit together (measured: docs/benchmarking.md, "PostgreSQL").
NOTIFY = (
    "SELECT pg_notify('{CHANNEL}', %s), set_config('synchronous_commit', 'off', true)"
).replace("{CHANNEL}", CHANNEL)
# The same, only if another server waits on one of the queues (or on every queue): checked
# after the commit, in the notification's own transaction (waiters.py says why that order
# loses no wake-up). An index probe per queue, and no transaction id when nobody waits.
# Its queues through a sub-select (as sql.opaque, which this module cannot import): the
# generic plan holds whatever their number.
NOTIFY_IF_WAITED = (
    NOTIFY + " WHERE EXISTS (SELECT FROM waiters "
    "WHERE queue = ANY((SELECT %s::text[])::text[]) AND origin <> %s)"
)
# PostgreSQL refuses payloads of 8,000 bytes or more; a commit that readied more queues
# than fit says "every queue" instead.
MAX_PAYLOAD = 7_900


def payload(origin: str, changes: Changes, expiry: bool = True) -> str | None:
    """The notification of a commit of ``changes`` (None: nothing anyone waits for);
    without its lease expiry if not ``expiry`` (see ``ExpiryTold``)."""
    note = _note(origin, changes, expiry)
    return None if note is None else note[0]


def _note(origin: str, changes: Changes, expiry: bool) -> tuple[str, bool] | None:
    """``payload``, and whether it says "every queue" (too many to name)."""
    if (
        not changes.ready_queues
        and changes.next_due_at is None
        and (changes.next_expiry_at is None or not expiry)
        and changes.next_schedule_at is None
    ):
        return None
    queues = sorted(changes.ready_queues)
    note: dict = {"o": origin, "q": queues}
    if changes.ready_counts:  # jobs made ready, per queue of "q" (how many long-polls wake)
        note["n"] = [changes.ready_counts.get(queue, 1) for queue in queues]
    if changes.next_due_at is not None:
        note["d"] = changes.next_due_at
    if changes.next_expiry_at is not None and expiry:
        note["e"] = changes.next_expiry_at
    if changes.next_schedule_at is not None:  # a schedule's next slot (put or resumed)
        note["s"] = changes.next_schedule_at
    text = orjson.dumps(note).decode()
    if len(text.encode()) < MAX_PAYLOAD:
        return text, False
    note["q"], note["all"] = [], True
    note.pop("n", None)
    return orjson.dumps(note).decode(), True


def statement(origin: str, changes: Changes, expiry: bool = True) -> tuple[str, tuple] | None:
    """The statement that notifies of a commit of ``changes`` (see ``payload``), and its
    values: conditional on a waiting server if it only tells of ready jobs, and of at most
    as many queues as fit in one notification."""
    note = _note(origin, changes, expiry)
    if note is None:
        return None
    text, every = note
    only_ready = (
        changes.next_due_at is None
        and (changes.next_expiry_at is None or not expiry)
        and changes.next_schedule_at is None
    )
    if only_ready and not every:
        return NOTIFY_IF_WAITED, (text, [EVERY, *sorted(changes.ready_queues)], origin)
    return NOTIFY, (text,)


class ExpiryTold:
    """The earliest lease expiry this store's notifications told the other servers of and
    that is still to come: a later one need not be told. Each server's reaper, woken at
    that expiry, reads the earliest expiry of every lease from the database
    (``NextDeadlines``), later ones included, and so does a server as it starts or
    listens again; a notification only wakes a reaper earlier than it would wake anyway
    (it looks at least every ``MAX_SLEEP_MS``). So a run of claims, each setting an
    expiry a lease later than the one before, notifies once per lease time, not once
    per commit, unless it readies jobs or sets another deadline."""

    def __init__(self) -> None:
        self.at: int | None = None  # the expiry told, if still to come at ``now``
        self.now = 0  # the latest ``now`` a command that sets an expiry was given

    def needed(self, expiry: int | None) -> bool:
        """Whether a commit that sets ``expiry`` must tell it."""
        return expiry is not None and (self.at is None or self.at <= self.now or expiry < self.at)

    def told(self, expiry: int) -> None:
        """A commit told ``expiry``."""
        self.at = expiry

    def forget(self) -> None:
        """Whether what was told arrived is not known (a commit whose outcome is not):
        the next expiry is told."""
        self.at = None


def parse(text: str, origin: str) -> Changes | bool | None:
    """A notification as the ``Changes`` it stands for; None if it is ``origin``'s own
    (or not one of ours); True if it stands for every queue."""
    try:
        note = orjson.loads(text)
        if note.get("o") == origin:
            return None
        if note.get("all"):
            return True
        queues, counts = note.get("q", ()), note.get("n")
        if not isinstance(counts, list):
            counts = []
        changes = Changes()
        for i, queue in enumerate(queues):
            if isinstance(queue, str):
                n = counts[i] if i < len(counts) else 1
                changes.made_ready(queue, n if type(n) is int and n > 0 else 1)
        due, expiry, slot = note.get("d"), note.get("e"), note.get("s")
        if isinstance(due, int):
            changes.due(due)
        if isinstance(expiry, int):
            changes.expiry(expiry)
        if isinstance(slot, int):
            changes.schedule(slot)
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        return None
    return changes
