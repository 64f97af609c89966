"""This server's rows in ``waiters``: the queues it has long-polls parked on, which other
servers' commits to them must tell it of (relay/store/postgres/waiters.py). PostgreSQL only.

One task, ``WaiterRows.run``, under the core's services. A lease that parks on a queue with
no row of ours wakes it: it writes the row and, once that is committed, wakes the leases
parked on the queues whose rows are new, to claim again (a commit elsewhere before the row
told nobody). Rows are renewed every RENEW_S (each lasts TTL_MS, for the servers that clean
up after one that stopped) while leases park on their queue within LINGER_S, then removed.
Past MAX_ROWS queues, one row for every queue instead (until they are half as many).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Protocol

import trio

from relay.protocol.errors import RelayError, ShuttingDown, Unavailable
from relay.store import commands as cmd
from relay.store.postgres.notify import EVERY
from relay.store.writer import Writer

log = logging.getLogger("relay.waiters")

RENEW_S = 20.0
TTL_MS = 60_000
LINGER_S = 30.0
MAX_ROWS = 1_000
ERROR_BACKOFF_S = 1.0
# How long a stopping server tries to remove its rows (else they go STALE_MS after TTL_MS).
REMOVE_S = 1.0


class LongPolls(Protocol):
    """What this service asks of the long-poll hub (relay/server/requests/longpoll.py)."""

    def parked_on(self, queue: str) -> bool: ...
    def queues(self) -> set[str]: ...
    def wake_queues(self, queues: set[str]) -> None: ...


class WaiterRows:
    """Keeps this server's rows of ``waiters`` in step with its parked long-polls."""

    def __init__(self, writer: Writer, longpolls: LongPolls) -> None:
        self._writer = writer
        self._longpolls = longpolls
        self._seen: dict[str, float] = {}  # queue -> when a lease last parked on it
        self.held: set[str] = set()  # the queues with a row of ours, as last committed
        # Queues of a write whose outcome is not known (its rows may be there): put or
        # dropped by the next write, and woken after it if put.
        self._unsure: set[str] = set()
        self._pending: tuple[str, ...] = ()  # the put of the write under way
        self._wanted = trio.Event()  # a lease parked on a queue without a row
        self.writes = 0

    def parked(self, queues: tuple[str, ...]) -> None:
        """``LongPolls.on_park``: a lease parked on ``queues``."""
        now = trio.current_time()
        for queue in queues:
            self._seen[queue] = now
        if EVERY not in self.held and not self.held.issuperset(queues):
            self._wanted.set()

    def _rows(self, now: float) -> set[str]:
        """The queues that should have a row now."""
        parked_on = self._longpolls.parked_on
        self._seen = {q: at for q, at in self._seen.items() if now - at < LINGER_S or parked_on(q)}
        most = MAX_ROWS // 2 if EVERY in self.held else MAX_ROWS  # (no flapping at the edge)
        return set(self._seen) if len(self._seen) <= most else {EVERY}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the rows as leases park, renew and remove them, until cancelled; then
        remove them (at most REMOVE_S)."""
        task_status.started()
        try:
            await self._run()
        finally:
            # (A write under way still runs: its rows go too, removed after it.)
            if mine := self.held | self._unsure | set(self._pending):
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(REMOVE_S),
                    contextlib.suppress(RelayError),
                ):
                    await self._writer.execute(cmd.PutWaiters((), tuple(sorted(mine)), 0))

    async def _run(self) -> None:
        renew_at = math.inf
        while True:
            with trio.move_on_at(renew_at):
                await self._wanted.wait()
            self._wanted = trio.Event()
            now = trio.current_time()
            rows = self._rows(now)
            renew = now >= renew_at
            put = rows if renew else rows - self.held
            drop = (self.held | self._unsure) - rows
            if not put and not drop:
                if renew:  # (nothing held: nothing to renew until a lease parks)
                    renew_at = now + RENEW_S if self.held else math.inf
                continue
            self._pending = tuple(sorted(put))
            try:
                new = await self._writer.execute(
                    cmd.PutWaiters(self._pending, tuple(sorted(drop)), TTL_MS)
                )
            except ShuttingDown:  # (refused: not written)
                self._pending = ()
                return
            except Exception as exc:
                # Its outcome is not known: neither its rows nor its removals are taken
                # for done (a lease that parks on a dropped queue asks for its row again).
                self._pending = ()
                self.held -= drop
                self._unsure |= put | drop
                if isinstance(exc, Unavailable):
                    log.debug("waiters.unavailable")
                else:
                    log.exception("waiters.failed")
                await trio.sleep(ERROR_BACKOFF_S)
                self._wanted.set()
                continue
            self._pending = ()
            self.writes += 1
            # A new row wakes its queue's leases (it was missing: a commit may have gone
            # untold), as does one that may be new (a failed write's) unless the row was
            # known there before; none does while our row for every queue stood.
            before = self.held
            self.held = (self.held - drop) | put
            woken = set(new) | ((self._unsure & put) - before)
            self._unsure.clear()
            if EVERY in before and EVERY not in new:
                woken = set()
            if EVERY in woken:
                woken = self._longpolls.queues() - (before - {EVERY})
            if woken:
                self._longpolls.wake_queues(woken)
            if renew or renew_at == math.inf:
                renew_at = now + RENEW_S
            if not self.held:
                renew_at = math.inf
            # Leases may have parked meanwhile on queues this write dropped: look again.
            self._wanted.set()
