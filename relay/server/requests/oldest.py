"""``OldestReady``: how long the oldest ready job of each queue has waited, for ``stats``
with ``oldest_ready``, read through the writer at most once a second per queue.

Each queue costs a few index seeks in the writer thread (``Store.oldest_ready_ms``): about
10 us on SQLite, so 10 ms for a page of 1,000 queues. Dashboards ask every second, many at
once, and a client may ask as often as it likes: so each queue's oldest ready time is
kept for ``ttl_s``, askers of a queue being read wait for that read, and the reads go to
the writer one at a time in chunks of ``CHUNK`` queues. The writer then spends at most
one chunk's time (~2.5 ms) of any batch on them, and at most one read per queue with
ready jobs per ``ttl_s`` (at 10,000 such queues, ~0.1 s of writer time a second). An age
given is at most ``ttl_s`` old: a job claimed since may still be counted as the oldest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from relay.store import commands as cmd
from relay.store.writer import Writer

# How long a queue's oldest ready time is kept: a dashboard asks once a second.
TTL_S = 1.0
# Queues per read in the writer: ~2.5 ms of its time on SQLite (measured: 10 us a queue).
CHUNK = 250


class OldestReady:
    """Trio thread only. Owns no task: a ``stats`` request's task calls ``ages``."""

    def __init__(self, writer: Writer, clock: Callable[[], int], ttl_s: float = TTL_S) -> None:
        self.writer = writer
        self.clock = clock  # the store's clock (wall milliseconds): ages are now - ready_at
        self.ttl_s = ttl_s
        # queue -> (trio time read, ready_at of its oldest ready job, or None: none ready)
        self._known: dict[str, tuple[float, int | None]] = {}
        self._reading: dict[str, trio.Event] = {}  # queue -> set when its read is done
        self._lock = trio.Lock()  # one read in the writer at a time

    async def ages(self, queues: Sequence[str]) -> dict[str, int]:
        """Per queue of ``queues`` with a ready job: how long (ms) its oldest has waited,
        as read at most ``ttl_s`` ago.

        Raises what the writer raises (ShuttingDown, Unavailable). Cancellation: a read
        already queued still runs; its askers read it again."""
        now = trio.current_time()
        known, reading = self._known, self._reading
        stale = [q for q in queues if (k := known.get(q)) is None or now - k[0] >= self.ttl_s]
        others = {reading[q] for q in stale if q in reading}
        mine = [q for q in stale if q not in reading]
        if mine:
            done = trio.Event()
            for queue in mine:
                reading[queue] = done
            try:
                await self._read(mine)
            finally:
                for queue in mine:
                    if reading.get(queue) is done:
                        del reading[queue]
                done.set()
        for other in others:
            await other.wait()
        clock_ms = self.clock()
        ages = {}
        for queue in queues:
            entry = known.get(queue)
            if entry is not None and entry[1] is not None:
                ages[queue] = max(0, clock_ms - entry[1])
        return ages

    async def _read(self, queues: list[str]) -> None:
        known = self._known
        for start in range(0, len(queues), CHUNK):
            part = tuple(queues[start : start + CHUNK])
            async with self._lock:
                found = await self.writer.execute(cmd.OldestReadyAt(part))
            at = trio.current_time()
            for queue in part:
                known[queue] = (at, found.get(queue))
        if len(known) > 2 * CHUNK and len(known) > 4 * len(queues):
            # Forget what has expired, so this holds about the queues asked of late.
            self._known = {q: k for q, k in known.items() if at - k[0] < self.ttl_s}
