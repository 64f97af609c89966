"""Parked long-poll leases: woken by commits that make jobs ready, answered at their deadline.

A ``lease`` with ``wait_ms`` that finds nothing is parked here, inside the delivery of its
empty result (so it is registered before any later commit's wake-ups are delivered). One
task, ``LongPolls.run``, serves every parked lease: it re-sends the claims of the woken
ones and answers ``jobs: []`` to those whose deadline passed. No per-request task, and no
polling of the database: a parked lease costs nothing until its queue gets a ready job.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import Protocol

import attrs
import trio

from relay.errors import ShuttingDown
from relay.log import Summary, event
from relay.store.base import Changes
from relay.store.items import Item, ReplySink
from relay.store.writer import Writer

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
# The log says the cap turned long-polls away at most this often (with how many).
FULL_LOG_INTERVAL_S = 60.0


class LeaseArgs(Protocol):
    """What a parked lease must tell the hub: the args of its writer item (the
    dispatcher's ``PendingLease``)."""

    queues: tuple[str, ...]
    deadline: float  # trio time
    max_bytes: int | None  # its claim's budget of job texts
    reply_bytes: int  # the most its reply may take (what it reserved when it arrived)
    job_bytes: int  # the most one job takes in it
    reserved: int  # what it holds reserved now (nothing while parked)


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


class LongPolls:
    """The registry of parked leases and the one task that serves them."""

    def __init__(self, writer: Writer, max_parked: float = math.inf) -> None:
        self._writer = writer
        self.max_parked = max_parked
        self._turned_away = Summary(FULL_LOG_INTERVAL_S)  # logged in summary: a flood
        self._by_queue: dict[str, set[_Parked]] = {}
        self._by_sink: dict[int, set[_Parked]] = {}  # id(sink): a closing connection's
        self._deadlines: list[tuple[float, int, _Parked]] = []
        self._order = itertools.count()
        self._woken: list[_Parked] = []
        # id(sink) -> its leases woken while it had no room for their replies: parked
        # again, and woken once it has room (room_made).
        self._short: dict[int, set[_Parked]] = {}
        self._lot = trio.lowlevel.ParkingLot()
        self._parked = 0
        self.closing = False

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
        """Register a lease that found nothing. Sync: called from a reply delivery."""
        self._register(item, sink)

    def _register(self, item: Item, sink: LongPollSink) -> _Parked:
        entry = _Parked(item, sink)
        lease: LeaseArgs = item[4]
        self._parked += 1
        for queue in lease.queues:
            self._by_queue.setdefault(queue, set()).add(entry)
        self._by_sink.setdefault(id(sink), set()).add(entry)
        heapq.heappush(self._deadlines, (lease.deadline, next(self._order), entry))
        if len(self._deadlines) > 2 * self.parked + COMPACT_SLACK:
            # Leases answered before their deadline (woken, dropped, ended) leave their
            # entries behind until that deadline; a busy long-poll consumer would pile
            # them up for max_wait_ms, so keep only the live ones.
            self._deadlines = [item for item in self._deadlines if item[2].active]
            heapq.heapify(self._deadlines)
        self._lot.unpark_all()  # the earliest deadline may have changed
        return entry

    def on_commit(self, changes: Changes) -> None:
        """Commit listener: wake every lease parked on a queue that got ready jobs."""
        woke = False
        for queue in changes.ready_queues:
            for entry in list(self._by_queue.get(queue, ())):
                self._unregister(entry)
                self._woken.append(entry)
                woke = True
        if woke:
            self._lot.unpark_all()

    def wants(self, changes: Changes) -> bool:
        """Writer thread: whether ``on_commit`` would wake a lease (plain reads only)."""
        by_queue = self._by_queue
        return any(queue in by_queue for queue in changes.ready_queues)

    def wake_all(self) -> None:
        """Wake every parked lease to claim again: commits may have been missed (another
        server's, while the feed of them was down)."""
        for entries in list(self._by_queue.values()):
            for entry in list(entries):
                if entry.active:
                    self._unregister(entry)
                    self._woken.append(entry)
        self._lot.unpark_all()

    def parked_for(self, sink: LongPollSink) -> bool:
        return id(sink) in self._by_sink

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
        # Woken but not yet claimed again: answered now too, and never claimed.
        woken, self._woken = self._woken, []
        for entry in woken:
            entry.sink.deliver([(entry.item, [])])
        self._lot.unpark_all()

    def _unregister(self, entry: _Parked) -> None:
        entry.active = False
        self._parked -= 1
        for registry in (self._by_sink, self._short):
            mine = registry.get(id(entry.sink))
            if mine is not None:
                mine.discard(entry)
                if not mine:
                    del registry[id(entry.sink)]
        for queue in entry.item[4].queues:
            waiting = self._by_queue.get(queue)
            if waiting is not None:
                waiting.discard(entry)
                if not waiting:
                    del self._by_queue[queue]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve parked leases until cancelled."""
        task_status.started()
        while True:
            while self._woken:
                await self._writer.wait_room()  # (not a checkpoint while it has room)
                if not self._woken:
                    break
                entry = self._woken.pop()
                sink, item = entry.sink, entry.item
                lease: LeaseArgs = item[4]
                if self.closing or not sink.can_wait:
                    sink.deliver([(item, [])])  # nobody to lease for
                    continue
                # Its claim goes round again; an empty answer parks it anew (until its
                # deadline), a job answers it. Its reply is reserved again, within the
                # room its connection has left: woken together, a connection's many
                # long-polls must not bring it more than its reply budget. Without room
                # for one job (its client is that far behind on its replies), it parks
                # again until the client takes some (room_made) or its deadline.
                room = sink.reply_room()
                if room < lease.job_bytes:
                    self._short.setdefault(id(sink), set()).add(self._register(item, sink))
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
