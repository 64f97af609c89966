"""``WorkerBook``: this server's connections that have leased, for ``workers_list`` and
the ``relay_workers{queue}`` gauge.

A worker here is a connection that has sent a lease (its role worker or admin), known by
the worker id of its last lease; one connection may lease under several worker ids (the
last ``WORKER_IDS_KEPT`` are kept), and it is one worker, listed once. The book is kept
off the hot path: a lease request costs one dict look-up and a few attribute writes
(``leased``); an ack, a fail or a renew costs nothing here.

What a worker holds now is read from the store when asked (``Store.leases_held``: the
unexpired leases of its worker ids, with each attempt's start), so it is true whichever
connection acked a job (a worker that reconnected acks on its new one) and however long
ago a job was leased, and a lease that expired is not shown.

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
# Leases read from the store per request, at most (past it, ``held_truncated``).
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


class WorkerBook:
    def __init__(self) -> None:
        self._records: dict[Connection, WorkerRecord] = {}  # in the order of first leases
        self._clients: dict[Connection, str] = {}  # the client names given in hellos
        self._seq = itertools.count(1)

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
        """The fields of a ``workers_list`` reply:
        up to ``limit`` workers after ``cursor``, with what they hold now read from the
        store. ``clock``: the store's (wall ms); ``parked(connection)``: its parked long-polls."""
        after = int(cursor) if cursor else 0
        chosen: list[tuple[Connection, WorkerRecord]] = []
        for connection, record in self._records.items():
            if record.seq > after:
                chosen.append((connection, record))
                if len(chosen) > limit:
                    break
        more = len(chosen) > limit
        chosen = chosen[:limit]
        names = sorted({w for _, record in chosen for w in record.worker_ids})
        held: list[tuple[str, str, str, int, int | None]] = []
        now_ms = None
        if names:
            held, now_ms = await writer.execute(cmd.LeasesHeld(tuple(names), HELD_READ))
        trio_now = trio.current_time()
        if now_ms is None:
            now_ms = clock()
        by_worker: dict[str, list[WorkerRecord]] = {}
        for _, record in chosen:
            for w in record.worker_ids:
                by_worker.setdefault(w, []).append(record)
        jobs_of: dict[int, list[dict[str, Any]]] = {id(r): [] for _, r in chosen}
        for job_id, queue, worker_id, expires, at in held:
            owners = by_worker.get(worker_id, ())
            if not owners:
                continue
            # One connection: its own. Several under one worker id: the one that leased last.
            owner = max(owners, key=lambda r: r.last_lease)
            jobs_of[id(owner)].append({
                "job_id": job_id, "queue": queue, "worker_id": worker_id,
                "held_ms": None if at is None else max(0, now_ms - at),
                "lease_expires_at": expires,
            })  # fmt: skip

        def wall(t: float) -> int:
            return now_ms - max(0, round((trio_now - t) * 1000))

        entries = []
        for connection, record in chosen:
            jobs = jobs_of[id(record)]
            jobs.sort(key=lambda j: -1 if j["held_ms"] is None else -j["held_ms"])
            helds = [j["held_ms"] for j in jobs if j["held_ms"] is not None]
            queues = sorted(record.queues())
            last = max(record.last_lease, getattr(connection, "last_request", record.last_lease))
            entries.append({
                "worker_id": record.worker_id,
                "worker_ids": list(reversed(record.worker_ids)),
                "client": self._clients.get(connection),
                "peer": connection.peer,
                "queues": queues[:QUEUES_SHOWN],
                "queues_total": len(queues),
                "jobs": jobs[:JOBS_SHOWN],
                "jobs_held": len(jobs),
                "longest_held_ms": max(helds) if helds else None,
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
            "held_truncated": len(held) >= HELD_READ,
            "at": now_ms,
        }
        return reply


assert WORKERS_PAGE * ENTRY_BYTES < 32 * 1024 * 1024  # within a connection's MAX_OWED_BYTES
