"""Parked long-poll leases: woken by commits that make jobs ready, answered at their deadline.

A ``lease`` with ``wait_ms`` that finds nothing is parked here, inside the delivery of its
empty result (so it is registered before any later commit's wake-ups are delivered). One
task, ``LongPolls.run``, serves every parked lease: it re-sends the claims of the woken
ones and answers ``jobs: []`` to those whose deadline passed. No per-request task, and no
polling of the database: a parked lease costs nothing until its queue gets a ready job.

No herd: a commit that made ``n`` jobs ready in a queue wakes parked leases on it until
their counts add up to ``n`` (``Changes.ready_counts``), not every lease parked on it. Whom:
the connections parked on the queue take turns (the one served longest ago first), and
each connection's leases go in the order they first parked. A woken lease that finds
nothing parks again at its old place (it keeps ``place``). A woken lease that cannot take
its share (its client went or has no room for a reply, or its claim stopped at its byte
budget) passes it on: here, or in the writer thread (relay/server/requests/ops.py, ``_pass_on``),
as jobs made ready by its commit. So a job made ready while leases are parked is leased by
one of them, or stays ready for the next lease.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from relay.protocol.errors import ShuttingDown
from relay.store.base import Changes
from relay.store.items import Item, ReplySink
from relay.store.writer import Writer
from relay.util.log import Summary, event

log = logging.getLogger("relay.longpoll")

# How many entries for leases no longer parked the deadline heap may hold beyond twice
# the parked ones before it is rebuilt (a rebuild is linear, so it is kept rare).
COMPACT_SLACK = 1024
# Parked long-polls per allowed connection, server-wide: 16,384 with the default 1,024
# connections, ~2.5 KB each with 16 queues. Without a cap, max_connections clients each
# pipelining max_in_flight long-polls would park 262,144 of them (~700 MB), and parking or
# dropping them all would hold the trio thread for seconds. Past it, a lease that finds
# nothing is answered ``jobs: []`` at once, as if its wait had ended.
PARKED_PER_CONNECTION = 16
# Other servers' commits that made jobs ready, remembered per queue for this long (the
# memory cleared of older ones once it holds HEARD_MAX queues, or twice as many as it kept
# at the last clearing): a claim on its way longer than that is not looked after (the
# writer answers in milliseconds).
HEARD_S, HEARD_MAX = 10.0, 4096
# The log says the cap turned long-polls away at most this often (with how many).
FULL_LOG_INTERVAL_S = 60.0


class LeaseArgs(Protocol):
    """What a parked lease must tell the hub: the args of its writer item (the
    dispatcher's ``PendingLease``)."""

    queues: tuple[str, ...]
    count: int  # the most jobs it takes
    deadline: float  # trio time
    max_bytes: int | None  # its claim's budget of job texts
    reply_bytes: int  # the most its reply may take (what it reserved when it arrived)
    job_bytes: int  # the most one job takes in it
    reserved: int  # what it holds reserved now (nothing while parked)
    woken: bool  # it parked once, and was woken to claim again
    place: int  # its place in the order of parking (from its first park; -1: none yet)
    sent: float  # trio time its claim was last handed to the writer


class LongPollSink(ReplySink, Protocol):
    """What a parked lease's connection offers the hub (a session, in the end)."""

    can_wait: bool  # False once its client has stopped sending or gone

    def reply_room(self) -> int: ...  # reply bytes it may still be owed (may be negative)
    def reserve(self, nbytes: int) -> None: ...


@attrs.define(eq=False, slots=True)
class _Parked:
    item: Item  # the lease's writer item: (op, sink, request id, started, LeaseArgs)
    sink: LongPollSink
    active: bool = True
    short: bool = False  # woken while its connection had no room: waits for room_made


# Per queue, the connections with leases parked on it, in turn order (the next to serve
# first), each with its leases as a heap of (place, order, entry) in the order they
# parked. Entries no longer parked stay in the heaps until they come up (or a rebuild),
# so a lease parked again may be in a heap twice (at one place: ``order`` breaks the tie).
_Turns = OrderedDict[int, list[tuple[int, int, _Parked]]]


class LongPolls:
    """The registry of parked leases and the one task that serves them."""

    def __init__(self, writer: Writer, max_parked: float = math.inf) -> None:
        self._writer = writer
        self.max_parked = max_parked
        self._turned_away = Summary(FULL_LOG_INTERVAL_S)  # logged in summary: a flood
        self._by_queue: dict[str, _Turns] = {}
        self._queued = 0  # entries in the heaps of _by_queue, live or not
        self._links = 0  # of those, the live ones: (queue, lease) pairs parked
        self._by_sink: dict[int, set[_Parked]] = {}  # id(sink): a closing connection's
        self._deadlines: list[tuple[float, int, _Parked]] = []
        self._order = itertools.count()
        self._woken: deque[_Parked] = deque()  # to claim again, the first woken first
        # id(sink) -> its leases woken while it had no room for their replies: parked
        # again, and woken once it has room (room_made).
        self._short: dict[int, set[_Parked]] = {}
        self._lot = trio.lowlevel.ParkingLot()
        self._parked = 0
        self.closing = False
        # Told the queues of each lease as it parks (the queues another server's commits
        # must tell this one of: relay/server/services/waiters.py).
        self.on_park: Callable[[tuple[str, ...]], None] | None = None
        # queue -> when another server's commit that made jobs ready in it was heard.
        self._heard: dict[str, float] = {}
        self._heard_limit = HEARD_MAX  # (its size at which it is cleared next)

    @property
    def parked(self) -> int:
        return self._parked

    @property
    def full(self) -> bool:
        return self._parked >= self.max_parked

    def turn_away(self) -> None:
        """A lease is answered at once because ``max_parked`` are parked: said in the log
        at most every FULL_LOG_INTERVAL_S, with how many."""
        if n := self._turned_away.count(trio.current_time()):
            event(log, logging.WARNING, "longpoll.full", parked=self._parked, turned_away=n)

    def park(self, item: Item, sink: LongPollSink) -> None:
        """Register a lease that found nothing (a woken one at its old place). Sync:
        called from a reply delivery.

        One whose claim was on its way as another server's commit to one of its queues
        was heard claims again at once: its claim may have looked before that commit,
        and the wake-up came before it parked (this server's own commits wake after the
        replies of their batch, so never come too early)."""
        entry = self._register(item, sink)
        lease: LeaseArgs = item[4]
        heard = self._heard
        if heard and any(heard.get(queue, -math.inf) > lease.sent for queue in lease.queues):
            self._unregister(entry)
            self._woken.append(entry)
            self._lot.unpark_all()

    def on_remote_commit(self, changes: Changes) -> None:
        """Commit listener for other servers' commits (the change feed): ``on_commit``,
        and the queues remembered for leases whose claims are on their way (``park``)."""
        now = trio.current_time()
        heard = self._heard
        for queue in changes.ready_queues:
            heard[queue] = now
        if len(heard) > self._heard_limit:
            self._heard = {q: at for q, at in heard.items() if now - at < HEARD_S}
            self._heard_limit = max(HEARD_MAX, 2 * len(self._heard))
        self.on_commit(changes)

    def _register(self, item: Item, sink: LongPollSink, short: bool = False) -> _Parked:
        entry = _Parked(item, sink, short=short)
        lease: LeaseArgs = item[4]
        if lease.place < 0:
            lease.place = next(self._order)
        self._parked += 1
        if not short:  # (one short of room is woken by room_made, not by commits)
            key = id(sink)
            for queue in lease.queues:
                turns = self._by_queue.get(queue)
                if turns is None:
                    turns = self._by_queue[queue] = OrderedDict()
                heapq.heappush(turns.setdefault(key, []), (lease.place, next(self._order), entry))
            self._queued += len(lease.queues)
            self._links += len(lease.queues)
            if self.on_park is not None:
                self.on_park(lease.queues)
        self._by_sink.setdefault(id(sink), set()).add(entry)
        heapq.heappush(self._deadlines, (lease.deadline, next(self._order), entry))
        if len(self._deadlines) > 2 * self.parked + COMPACT_SLACK:
            # Leases answered before their deadline (woken, dropped, ended) leave their
            # entries behind until that deadline; a busy long-poll consumer would pile
            # them up for max_wait_ms, so keep only the live ones.
            self._deadlines = [item for item in self._deadlines if item[2].active]
            heapq.heapify(self._deadlines)
        if self._queued > 2 * self._links + COMPACT_SLACK:
            self._compact_queues()
        self._lot.unpark_all()  # the earliest deadline may have changed
        return entry

    def _compact_queues(self) -> None:
        """Drop from the per-queue heaps the entries no longer parked (linear: kept rare,
        as for the deadlines)."""
        self._queued = 0
        for queue, turns in list(self._by_queue.items()):
            for key, heap in list(turns.items()):
                live = [each for each in heap if _waits(each[2])]
                if live:
                    heapq.heapify(live)
                    turns[key] = live
                    self._queued += len(live)
                else:
                    del turns[key]
            if not turns:
                del self._by_queue[queue]

    def on_commit(self, changes: Changes) -> None:
        """Commit listener: for each queue that got ready jobs, wake parked leases until
        their counts cover the jobs it got."""
        counts = changes.ready_counts
        woke = False
        for queue in changes.ready_queues:
            if queue in self._by_queue:
                woke = self._wake(queue, counts.get(queue, 1)) or woke
        if woke:
            self._lot.unpark_all()

    def _wake(self, queue: str, jobs: int) -> bool:
        """Wake leases parked on ``queue`` until their counts add up to ``jobs`` (or none
        is left): one per connection in turn, each connection's oldest first."""
        turns = self._by_queue[queue]
        woke = False
        while jobs > 0 and turns:
            key, heap = turns.popitem(last=False)
            entry = None
            while heap:
                candidate = heapq.heappop(heap)[2]
                self._queued -= 1
                if _waits(candidate):
                    entry = candidate
                    break
            if heap:
                turns[key] = heap  # its turn comes again after the others'
            if entry is not None:
                self._unregister(entry)
                self._woken.append(entry)
                jobs -= entry.item[4].count
                woke = True
        if not turns:
            del self._by_queue[queue]
        return woke

    def _pass_on(self, entry: _Parked) -> None:
        """``entry`` was woken and will not claim: the jobs it was woken for wake others."""
        lease: LeaseArgs = entry.item[4]
        for queue in lease.queues:
            if queue in self._by_queue:
                self._wake(queue, lease.count)

    def wants(self, changes: Changes) -> bool:
        """Writer thread: whether ``on_commit`` would wake a lease (plain reads only)."""
        by_queue = self._by_queue
        return any(queue in by_queue for queue in changes.ready_queues)

    def wake_queues(self, queues: set[str]) -> None:
        """Wake every lease parked on one of ``queues`` to claim again: commits to them
        may have gone untold (another server's, before this one's row in ``waiters``)."""
        woke = False
        for queue in queues:
            if queue in self._by_queue:
                woke = self._wake(queue, math.inf) or woke
        if woke:
            self._lot.unpark_all()

    def queues(self) -> set[str]:
        """The queues leases may be parked on (as ``parked_on``)."""
        return set(self._by_queue)

    def parked_on(self, queue: str) -> bool:
        """Whether a lease may be parked on ``queue`` (one no longer parked may still
        count until its entry comes up)."""
        return queue in self._by_queue

    def wake_all(self) -> None:
        """Wake every parked lease to claim again: commits may have been missed (another
        server's, while the feed of them was down)."""
        entries = sorted(
            [e for es in self._by_sink.values() for e in es if _waits(e)],
            key=lambda e: e.item[4].place,
        )
        for entry in entries:
            self._unregister(entry)
            self._woken.append(entry)
        self._by_queue.clear()
        self._queued = self._links = 0
        self._lot.unpark_all()

    def parked_for(self, sink: LongPollSink) -> bool:
        return id(sink) in self._by_sink

    def parked_count(self, sink: LongPollSink) -> int:
        """Leases parked for ``sink`` (workers_list)."""
        return len(self._by_sink.get(id(sink), ()))

    def short_of_room(self, sink: LongPollSink) -> bool:
        return id(sink) in self._short

    def room_made(self, sink: LongPollSink) -> None:
        """``sink`` has taken some of its replies: wake its leases that were woken while
        it had no room for theirs (they look at its room again)."""
        for entry in list(self._short.pop(id(sink), ())):
            self._unregister(entry)
            self._woken.append(entry)
        self._lot.unpark_all()

    def drop(self, sink: LongPollSink) -> None:
        """Answer now (with no jobs) every lease parked for ``sink``, whose client has
        stopped sending or gone; the request is accounted as finished either way."""
        self._short.pop(id(sink), None)
        for entry in list(self._by_sink.get(id(sink), ())):
            # A reply written meanwhile may have woken some (room_made): they are the
            # run task's now, and answered there.
            if entry.active:
                self._unregister(entry)
                sink.deliver([(entry.item, [])])

    def close(self) -> None:
        """Shutdown: answer every parked lease with no jobs, and park no more."""
        self.closing = True
        for _, _, entry in self._deadlines:
            if entry.active:
                self._unregister(entry)
                entry.sink.deliver([(entry.item, [])])
        self._deadlines.clear()
        self._by_queue.clear()
        self._queued = self._links = 0
        # Woken but not yet claimed again: answered now too, and never claimed.
        woken, self._woken = self._woken, deque()
        for entry in woken:
            entry.sink.deliver([(entry.item, [])])
        self._lot.unpark_all()

    def _unregister(self, entry: _Parked) -> None:
        """No longer parked (its entries in the queues' heaps go as they come up)."""
        entry.active = False
        self._parked -= 1
        if not entry.short:
            self._links -= len(entry.item[4].queues)
        for registry in (self._by_sink, self._short):
            mine = registry.get(id(entry.sink))
            if mine is not None:
                mine.discard(entry)
                if not mine:
                    del registry[id(entry.sink)]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve parked leases until cancelled."""
        task_status.started()
        while True:
            while self._woken:
                await self._writer.wait_room()  # (not a checkpoint while it has room)
                if not self._woken:
                    break
                entry = self._woken.popleft()
                sink, item = entry.sink, entry.item
                lease: LeaseArgs = item[4]
                if self.closing or not sink.can_wait:
                    sink.deliver([(item, [])])  # nobody to lease for
                    self._pass_on(entry)
                    continue
                # Its claim goes round again; an empty answer parks it anew (until its
                # deadline), a job answers it. Its reply is reserved again, within the
                # room its connection has left: woken together, a connection's many
                # long-polls must not bring it more than its reply budget. Without room
                # for one job (its client is that far behind on its replies), it parks
                # again until the client takes some (room_made) or its deadline.
                room = sink.reply_room()
                if room < lease.job_bytes:
                    short = self._register(item, sink, short=True)
                    self._short.setdefault(id(sink), set()).add(short)
                    self._pass_on(entry)
                    # Registered, then looked at again: the writer thread may have made
                    # room meanwhile, and it looks for leases short of room only after.
                    if sink.reply_room() >= lease.job_bytes:
                        self.room_made(sink)
                    continue
                lease.reserved = min(lease.reply_bytes, room)
                sink.reserve(lease.reserved)
                # A claim gives at least one job and may pass its budget by one: so the
                # reply stays within what it reserved. (Never more than its first budget:
                # reply_bytes is at most that plus one job.)
                lease.max_bytes = lease.reserved - lease.job_bytes
                lease.woken = True
                lease.sent = trio.current_time()
                try:
                    self._writer.put(item)
                except ShuttingDown:
                    sink.deliver([(item, [])])  # gives the reservation back
            now = trio.current_time()
            while self._deadlines and (
                self._deadlines[0][0] <= now or not self._deadlines[0][2].active
            ):
                _, _, entry = heapq.heappop(self._deadlines)
                if entry.active:
                    self._unregister(entry)
                    entry.sink.deliver([(entry.item, [])])
            next_deadline = self._deadlines[0][0] if self._deadlines else math.inf
            if self._woken:
                continue
            with trio.move_on_at(next_deadline):
                await self._lot.park()


def _waits(entry: _Parked) -> bool:
    """Whether ``entry`` is parked and may be woken by a commit."""
    return entry.active and not entry.short
