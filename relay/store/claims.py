"""Which jobs a run of claims leases, and their tokens: the same in every dialect.

A store's ``jobs_claim_many`` fetches candidates its own way (SQLite: the best few of
each (queue, priority class) from ``jobs_ready``; PostgreSQL: the same, locked with ``SKIP
LOCKED``) and writes the leases its own way; what lies between, the order of the claims
and which candidates each takes, is decided here once, so the two cannot drift.

A candidate is a row whose first five fields are (id, priority, ready_at, payload length,
queue); the rest is the dialect's, among them the job's execution timeout (``grant``'s
``timeout_at``: where it is in the row).
"""

from __future__ import annotations

import operator
import secrets
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from relay.protocol.model import TIMEOUT_GRACE_MS, Rate, effective_priority
from relay.store.base import (
    REPLY_OVERHEAD_BYTES,
    TOKEN_BYTES,
    Changes,
    ClaimArgs,
    QueueSettings,
)

# A queue without a limit's room.
MAX_ROOM = 2**62

# Oldest ready time first, then lowest id.
_BY_AGE = operator.itemgetter(2, 0)

# (queues of a group, jobs wanted) -> candidate rows: the dialect's fetch.
Fetch = Callable[[tuple[str, ...], int], list]


def choose(
    claims: Sequence[ClaimArgs], now: int, fetch: Fetch, room: dict[str, int] | None = None
) -> tuple[list[list[int]], dict[int, Sequence]]:
    """The ids each claim leases (by position), and each chosen id's candidate row.

    Claims are grouped by their set of queues, the groups in the order they first appear
    (among the claims that ask for at least one job), the claims of a group in the order
    given; each takes the best jobs the ones before it left: highest effective priority
    (aging, at ``now``), then oldest ready time, then lowest id, up to its count or until
    its payloads reach its byte budget (always at least one job).

    ``room``, if given, is how many jobs each limited queue may still lease (a queue not
    in it: any number): a candidate of a queue without room is passed over, and each job
    taken uses one. ``fetch`` may add to it (PostgreSQL learns which queues are limited
    from the candidates)."""
    chosen: list[list[int]] = [[] for _ in claims]
    found: dict[int, Sequence] = {}
    taken_from: dict[str, int] = {}  # queue -> jobs taken by earlier groups
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, (queues, _worker, count, _lease_ms, _max_bytes) in enumerate(claims):
        if count > 0 and queues:
            groups.setdefault(tuple(dict.fromkeys(queues)), []).append(i)
    for queues, members in groups.items():
        # Enough candidates for every member, even if earlier groups (claims on some of
        # these queues among others) took some of them.
        wanted = sum([claims[i][2] for i in members]) + sum([taken_from.get(q, 0) for q in queues])
        candidates = fetch(queues, wanted)
        # Within one (queue, class) the oldest job also has the highest effective
        # priority, so the best of all candidates are the best jobs overall.
        if len(candidates) > 1:
            base = candidates[0][1]
            if all([c[1] == base for c in candidates]):
                # One base class (the common case): aging never puts a younger job above
                # an older one, so the order is by age alone.
                candidates.sort(key=_BY_AGE)
            else:
                candidates.sort(key=lambda c: (-effective_priority(c[1], c[2], now), c[2], c[0]))
        available = (c for c in candidates if c[0] not in found)
        if room:  # (a limited queue's candidates beyond its room are passed over)
            available = _within(available, room)
        for i in members:
            count, max_bytes = claims[i][2], claims[i][4]
            mine, size = chosen[i], 0
            for candidate in available:
                key, length, queue = candidate[0], candidate[3], candidate[4]
                mine.append(key)
                found[key] = candidate
                taken_from[queue] = taken_from.get(queue, 0) + 1
                size += length + REPLY_OVERHEAD_BYTES
                if len(mine) == count or (max_bytes is not None and size >= max_bytes):
                    break
    return chosen, found


def _within(candidates: Iterator[Sequence], room: dict[str, int]) -> Iterator[Sequence]:
    """The candidates a limited queue has room for (taking one uses it)."""
    for candidate in candidates:
        queue = candidate[4]
        left = room.get(queue)
        if left is None:
            yield candidate
        elif left > 0:
            room[queue] = left - 1
            yield candidate


def room_for(settings: QueueSettings, leased: int, window: tuple[int | None, int], now: int) -> int:
    """How many jobs a limited queue may lease now: ``leased`` of it are, and its rate
    window (when it opened, leases in it) is ``window``. A window lasts its period from
    its first lease; once it has passed, the next lease opens a new one."""
    room = MAX_ROOM
    if settings.max_leased is not None:
        room = max(0, settings.max_leased - leased)
    rate = settings.rate
    if rate is not None:
        start, count = window
        if start is not None and now < start + rate.period_ms:
            room = min(room, max(0, rate.limit - count))
        else:
            room = min(room, rate.limit)
    return room


def window_after(
    rate: Rate, window: tuple[int | None, int], now: int, leased: int
) -> tuple[int, int]:
    """A rate window after ``leased`` more leases at ``now``: the same one if it is open,
    else a new one opened now."""
    start, count = window
    if start is not None and now < start + rate.period_ms:
        return start, count + leased
    return now, leased


def full_until(rate: Rate, window: tuple[int | None, int], now: int) -> int | None:
    """When a rate window that is open at ``now`` and full closes; None if it is not both
    (a window closed is no wait: the next lease opens a new one)."""
    start, count = window
    if start is None or count < rate.limit or now >= start + rate.period_ms:
        return None
    return start + rate.period_ms


def without_paused(claims: Sequence[ClaimArgs], paused: AbstractSet[str]) -> list[ClaimArgs]:
    """``claims`` with the ``paused`` queues left out of each (a claim left with none asks
    for nothing: ``choose`` skips it)."""
    return [
        claim
        if paused.isdisjoint(claim[0])
        else (tuple([q for q in claim[0] if q not in paused]), *claim[1:])
        for claim in claims
    ]


def grant(
    claims: Sequence[ClaimArgs],
    chosen: list[list[int]],
    now: int,
    found: dict[int, Sequence],
    timeout_at: int,
) -> list[list[tuple[int, str, str, int]]]:
    """Per claim, (id, token, worker, expires_at) of each job it leases: a random token
    each, from one call for all of them. A job with an execution timeout (its candidate's
    field ``timeout_at``) expires no later than its deadline, now + timeout + grace."""
    hex_digits = secrets.token_hex(TOKEN_BYTES * sum(map(len, chosen)))
    width = 2 * TOKEN_BYTES
    granted: list[list[tuple[int, str, str, int]]] = []
    at = 0  # where the next token's digits start
    for claim, mine in zip(claims, chosen, strict=True):
        worker, expires_at = claim[1], now + claim[3]
        granted.append(
            [
                (key, hex_digits[i : i + width], worker, expires_at)
                for key, i in zip(mine, range(at, at + width * len(mine), width), strict=True)
            ]
        )
        at += width * len(mine)
    timed = [key for key, candidate in found.items() if candidate[timeout_at] is not None]
    if timed:  # (rare: the common claim pays one look per job, above)
        deadlines = {key: now + found[key][timeout_at] + TIMEOUT_GRACE_MS for key in timed}
        for mine in granted:
            for n, (key, token, worker, expires_at) in enumerate(mine):
                if key in deadlines and deadlines[key] < expires_at:
                    mine[n] = (key, token, worker, deadlines[key])
    return granted


class RateWaits:
    """The rate-limited queues a claim found with a full window and ready jobs left: when
    each window closes, and how many jobs the next may lease. Nothing wakes a lease parked
    on such a queue but time, so the promoter's pass (``due``, at ``next_at``) reports
    them as made ready then. In memory: a restart forgets them, and the parked leases
    with them."""

    def __init__(self) -> None:
        self._waits: dict[str, tuple[int, int]] = {}

    def hold(self, queue: str, until: int, jobs: int) -> None:
        self._waits[queue] = (until, jobs)

    def after_claim(
        self,
        queue: str,
        rate: Rate,
        window: tuple[int | None, int],
        now: int,
        leased: int,
        waiting: int,
        changes: Changes,
    ) -> tuple[int, int] | None:
        """A rate-limited queue's window after a claim that leased ``leased`` of its jobs
        and left ``waiting`` ready: if that leaves it full (and open), the queue waits for
        its end, a due time. Returns the window to write, or None if it did not change."""
        after = window_after(rate, window, now, leased) if leased else window
        until = full_until(rate, after, now)
        if waiting > 0 and until is not None:
            self.hold(queue, until, min(waiting, rate.limit))
            changes.due(until)
        return after if leased else None

    def next_at(self) -> int | None:
        return min([until for until, _ in self._waits.values()], default=None)

    def due(self, now: int) -> list[tuple[str, int]]:
        """The queues whose window has closed by ``now``, forgotten: (queue, jobs)."""
        done = [(q, jobs) for q, (until, jobs) in self._waits.items() if until <= now]
        for queue, _ in done:
            del self._waits[queue]
        return done
