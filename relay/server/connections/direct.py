"""Replies the writer thread writes to a connection itself: a part of ``Session``.

After a commit, the writer thread offers each connection its replies of the batch
(``relay.store.items.offer``). A plain TCP connection whose outbox is idle (nothing queued,
nothing being sent) takes them if they are all reply lines: the thread writes them to its
socket at once (``Outbox.write_now``, under the outbox's lock) and counts them answered,
with counters that only it writes and the trio thread reads:

- ``_answered_now``: requests answered, taken from the session's in-flight count;
- ``_released_now``: reply bytes that the answered requests had reserved;
- the dispatcher's in-flight count and request durations (``AnsweredNow``,
  relay/server/requests/durations.py).

So the trio thread is not woken for a commit whose replies all went out, unless someone
there waits for what the replies change. Everyone who may wait says so before looking:
the reader waiting for room and a drain or a watch's pump (``Room.waiting``), a long-poll
short of room (``LongPolls.short_of_room``, registered before its room is looked at
again), shutdown waiting for no request in flight (``Dispatcher.idle_wanted``). The
thread counts first and looks after, so one of the two always sees the other: it then
answers TAKEN_WAKE, and ``after_now`` runs in the trio thread (the GIL makes each of these
reads and writes one step that the other thread sees in order).

Anything else goes to the trio thread as before (``Session.deliver``): a long-poll that
found nothing (the trio thread parks it), a TLS or WebSocket stream, an outbox with
replies queued, a write the socket refused; and, until that hand-off has been delivered
(``deliver_handed``), the replies of every later commit, which must not overtake it.
"""

from __future__ import annotations

import logging
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from relay.server.connections.outbox import NOT_WRITTEN, PART_WRITTEN
from relay.store.items import NOT_TAKEN, TAKEN, TAKEN_WAKE, Item

log = logging.getLogger("relay.session")

_ITEM = itemgetter(0)  # (of a pair: its item)

if TYPE_CHECKING:
    from relay.server.connections.outbox import Outbox
    from relay.server.connections.room import Room
    from relay.server.requests.dispatch import Dispatcher


class DirectReplies:
    """The writer thread's side of a session (``Session`` inherits it)."""

    dispatcher: Dispatcher
    _outbox: Outbox
    _room: Room
    _in_flight: int  # requests taken, less those answered through the trio thread
    _reserved: int  # reply bytes reserved by the requests in flight (trio thread)
    # Written by the writer thread only (see the module docstring).
    _answered_now = 0
    _released_now = 0
    _handed_out = 0  # commits whose replies it left to the trio thread (NOT_TAKEN)
    # Written by the trio thread only: of those, the hand-offs delivered.
    _handed_in = 0

    if TYPE_CHECKING:

        def deliver(self, pairs: list[tuple[Item, Any]]) -> None: ...  # (Session's)

    @property
    def in_flight(self) -> int:
        """Requests taken and not yet answered."""
        return self._in_flight - self._answered_now

    def deliver_now(self, pairs: list[tuple[Item, Any]]) -> int:
        """Writer thread: write the replies of one commit for this connection, if it can
        take them now; NOT_TAKEN, TAKEN or TAKEN_WAKE (``ReplySink``)."""
        # While an earlier commit's replies of this connection wait for their hand-off,
        # the outbox may look idle: these go after them, through the trio thread too.
        if self._handed_out == self._handed_in:
            lines = []
            for _item, reply in pairs:
                if type(reply) is not bytes:
                    break  # a long-poll that found nothing: the trio thread decides
                lines.append(reply)
            else:
                data = lines[0] if len(lines) == 1 else b"".join(lines)
                written = self._outbox.write_now(data)
                if written != NOT_WRITTEN:
                    return self._taken(pairs, written)
        self._handed_out += 1
        return NOT_TAKEN

    def deliver_handed(self, pairs: list[tuple[Item, Any]]) -> None:
        """Trio thread: the replies of one commit that ``deliver_now`` did not take, in
        that commit's hand-off. Once they are queued, the writer thread may write later
        commits' replies itself again."""
        try:
            self.deliver(pairs)
        finally:
            self._handed_in += 1

    def _taken(self, pairs: list[tuple[Item, Any]], written: int) -> int:
        # Written: whatever happens now, they are taken (they must not go out a second
        # time through the trio thread), and a failure wakes the trio side to be safe.
        try:
            # A request that reserved reply bytes holds them until answered, so if none
            # are held, none of these reserved (the common batch: submits, acks).
            if self._reserved != self._released_now:
                released = 0
                for item, _reply in pairs:
                    if item[0].reserves:  # (a lease, an inspect: what it reserved goes back)
                        released += item[4].reserved
                        item[4].reserved = 0
                self._released_now += released
                self._outbox.budget.owed_now -= released
            self._answered_now += len(pairs)
            dispatcher = self.dispatcher
            dispatcher.answered_now.answered(pairs)
            # Counted; now, who may wait for it.
            if (
                written == PART_WRITTEN
                or self._room.waiting
                or dispatcher.idle_wanted
                or dispatcher.longpolls.short_of_room(self)
            ):
                return TAKEN_WAKE
        except Exception:
            log.exception("counting the replies the writer wrote failed")
            return TAKEN_WAKE
        return TAKEN

    def after_now(self) -> None:
        """Trio thread: the writer thread wrote replies of this connection and someone may
        wait for it: write what the socket did not take, and wake the waiters."""
        self._outbox.flush()
        self._room.made()
        self.dispatcher.check_idle()
