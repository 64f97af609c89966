"""``WorkerBook``: this server's connections that have leased, for ``workers_list`` and
the ``relay_workers{queue}`` gauge.

A worker here is a connection that has sent a lease (its role worker or admin), known by
the worker id of its last lease; one connection may lease under several worker ids (the
last ``WORKER_IDS_KEPT`` are kept), and it is one worker, listed once. The book is kept
off the hot path: a lease request costs one dict look-up and a few attribute writes
(``leased``); an ack, a fail or a renew costs nothing here.

What a worker holds is read from the store (``Store.leases_held``: the unexpired leases
of the connected workers' ids, with each attempt's start), so it is true whichever
connection acked a job (a worker that reconnected acks on its new one) and however long
ago a job was leased, and a lease that expired is not shown. A read is of up to
HELD_READ leases, so there is one at a time, of every connected worker's, and it answers
every request made before it began: a connection that pipelines pages (or many that ask)
costs the writer one read at a time, not one per request in front of the other clients'
requests, and no reply is older than its request.

Trio thread only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
import trio

from relay.protocol.requests import WORKERS_PAGE
from relay.server.requests.connection import Connection
from relay.store import commands as cmd
from relay.store.writer import Writer

# Per connection: the worker ids of its last leases kept (the oldest forgotten first), and
# in a reply the jobs and queues shown (``jobs_held`` and ``queues_total`` count them all).
WORKER_IDS_KEPT = 4
JOBS_SHOWN = 10
QUEUES_SHOWN = 32
# Leases read from the store at once, at most (past it, ``held_truncated``).
HELD_READ = 10_000
# The most one connection's entry takes in a reply: its texts of up to 256 bytes (worker
# ids, client, the jobs' worker ids), each at most 6 times as long escaped, its queue
# names (128 characters that need no escaping) and the fields around them.
ENTRY_BYTES = (
    (WORKER_IDS_KEPT + 2) * 6 * 256 + QUEUES_SHOWN * 132 + JOBS_SHOWN * (6 * 256 + 250) + 500
)


@attrs.define(eq=False, slots=True)
class WorkerRecord:
    seq: int  # its place in the order connections first leased (the cursor)
    worker_id: str  # of its last lease
    first_lease: float  # trio time
    last_lease: float
    # worker id -> the queues of its last lease (the most recently changed last)
    worker_ids: dict[str, tuple[str, ...]]

    def queues(self) -> set[str]:
        return {queue for queues in self.worker_ids.values() for queue in queues}


# A lease held, as a reply shows it: (job id, queue, worker id, expires at, held ms).
Held = tuple[str, str, str, int, int | None]


def _longest_first(held: Held) -> int:
    return -1 if held[4] is None else -held[4]


@attrs.frozen
class HeldRead:
    """One read of the leases held by the connected workers: per worker id, how many
    and the JOBS_SHOWN held longest (the longest first)."""

    seq: int  # reads began before it, and it
    now_ms: int  # the store's clock at the read
    names: frozenset[str]  # the worker ids read
    counts: dict[str, int]
    longest: dict[str, list[Held]]
    longest_ms: dict[str, int]  # (of those whose attempt's start is known)
    truncated: bool  # HELD_READ leases read: there may be more

    @classmethod
    def of(cls, seq: int, names: frozenset[str], rows: list, now_ms: int) -> HeldRead:
        by_worker: dict[str, list[Held]] = {}
        for job_id, queue, worker_id, expires, leased_at in rows:
            held_ms = None if leased_at is None else max(0, now_ms - leased_at)
            by_worker.setdefault(worker_id, []).append((job_id, queue, worker_id, expires, held_ms))
        counts = {worker_id: len(held) for worker_id, held in by_worker.items()}
        longest = {
            worker_id: sorted(held, key=_longest_first)[:JOBS_SHOWN]
            for worker_id, held in by_worker.items()
        }
        longest_ms = {}
        for worker_id, held in by_worker.items():
            known = [held_ms for *_, held_ms in held if held_ms is not None]
            if known:
                longest_ms[worker_id] = max(known)
        return cls(seq, now_ms, names, counts, longest, longest_ms, len(rows) >= HELD_READ)


class WorkerBook:
    def __init__(self) -> None:
        self._records: dict[Connection, WorkerRecord] = {}  # in the order of first leases
        self._clients: dict[Connection, str] = {}  # the client names given in hellos
        self._seq = itertools.count(1)
        self._held: HeldRead | None = None  # the last read of the leases held
        self._reads = 0  # reads of them begun
        self._reading = trio.Lock()  # one at a time

    def __len__(self) -> int:
        return len(self._records)

    def hello(self, connection: Connection, client: str | None) -> None:
        if client:
            self._clients[connection] = client
        else:
            self._clients.pop(connection, None)

    def leased(
        self, connection: Connection, worker_id: str, queues: tuple[str, ...], now: float
    ) -> WorkerRecord:
        """A lease request of ``connection`` (per lease: kept cheap)."""
        record = self._records.get(connection)
        if record is None:
            record = WorkerRecord(next(self._seq), worker_id, now, now, {})
            self._records[connection] = record
        record.last_lease = now
        record.worker_id = worker_id
        ids = record.worker_ids
        if ids.get(worker_id) != queues:
            ids.pop(worker_id, None)
            ids[worker_id] = queues
            if len(ids) > WORKER_IDS_KEPT:
                del ids[next(iter(ids))]
        return record

    def forget(self, connection: Connection) -> None:
        """``connection`` has closed."""
        self._records.pop(connection, None)
        self._clients.pop(connection, None)

    def queue_counts(self) -> dict[str, int]:
        """Per queue, the connected workers asking for it (in their last leases)."""
        counts: dict[str, int] = {}
        for record in self._records.values():
            for queue in record.queues():
                counts[queue] = counts.get(queue, 0) + 1
        return counts

    async def page(
        self,
        writer: Writer,
        clock: Callable[[], int],
        cursor: str | None,
        limit: int,
        server: str,
        parked: Any,
    ) -> dict[str, Any]:
        """The fields of a ``workers_list`` reply: up to ``limit`` workers after
        ``cursor``, with what they hold read from the store (``leases_held``).
        ``clock``: the store's (wall ms); ``parked(connection)``: its parked long-polls."""
        after = int(cursor) if cursor else 0
        chosen: list[tuple[Connection, WorkerRecord]] = []
        for connection, record in self._records.items():
            if record.seq > after:
                chosen.append((connection, record))
                if len(chosen) > limit:
                    break
        more = len(chosen) > limit
        chosen = chosen[:limit]
        names = {w for _, record in chosen for w in record.worker_ids}
        held = await self.leases_held(writer, names) if names else None
        trio_now = trio.current_time()
        now_ms = clock() if held is None else held.now_ms
        # One connection: a worker id's jobs are its own. Several under one worker id: the
        # one that leased last's.
        owner: dict[str, WorkerRecord] = {}
        for _, record in chosen:
            for w in record.worker_ids:
                if w not in owner or record.last_lease > owner[w].last_lease:
                    owner[w] = record

        def wall(t: float) -> int:
            return now_ms - max(0, round((trio_now - t) * 1000))

        entries = []
        for connection, record in chosen:
            mine = [w for w in record.worker_ids if owner[w] is record]
            jobs: list[Held] = []
            held_n, longest = 0, None
            if held is not None:
                for w in mine:
                    jobs += held.longest.get(w, ())
                    held_n += held.counts.get(w, 0)
                    ms = held.longest_ms.get(w)
                    if ms is not None and (longest is None or ms > longest):
                        longest = ms
                jobs.sort(key=_longest_first)
            queues = sorted(record.queues())
            last = max(record.last_lease, getattr(connection, "last_request", record.last_lease))
            entries.append({
                "worker_id": record.worker_id,
                "worker_ids": list(reversed(record.worker_ids)),
                "client": self._clients.get(connection),
                "peer": connection.peer,
                "queues": queues[:QUEUES_SHOWN],
                "queues_total": len(queues),
                "jobs": [
                    {"job_id": job_id, "queue": queue, "worker_id": worker_id,
                     "held_ms": held_ms, "lease_expires_at": expires}
                    for job_id, queue, worker_id, expires, held_ms in jobs[:JOBS_SHOWN]
                ],
                "jobs_held": held_n,
                "longest_held_ms": longest,
                "connected_at": wall(getattr(connection, "opened_at", record.first_lease)),
                "first_lease_at": wall(record.first_lease),
                "last_request_at": wall(last),
                "parked": parked(connection),
            })  # fmt: skip
        reply = {
            "server": server,
            "workers": entries,
            "total": len(self._records),
            "next_cursor": str(chosen[-1][1].seq) if more else None,
            "held_truncated": held is not None and held.truncated,
            "at": now_ms,
        }
        return reply

    async def leases_held(self, writer: Writer, names: set[str]) -> HeldRead:
        """The leases held by (at least) the worker ids ``names``, read after this call
        began: by the read that began next, which every call waiting for it shares (one
        read at a time), of every connected worker's."""
        begun = self._reads
        async with self._reading:
            held = self._held
            if held is None or held.seq <= begun or not names <= held.names:
                self._reads += 1
                seq = self._reads
                every = frozenset(w for r in self._records.values() for w in r.worker_ids)
                every |= names  # (a connection that closed meanwhile: still asked for)
                rows, now_ms = await writer.execute(cmd.LeasesHeld(tuple(sorted(every)), HELD_READ))
                held = self._held = HeldRead.of(seq, every, rows, now_ms)
            return held


assert WORKERS_PAGE * ENTRY_BYTES < 32 * 1024 * 1024  # within a connection's MAX_OWED_BYTES
