"""The writer thread's body: batches, the passes that run them, commits, and the hand-off.

The thread takes every item already queued, forms a batch of at most ``max_batch`` of
them with the connections taking turns and each one's share bounded (``take_batch``), and
runs it in one transaction, commits once, makes the replies, writes those that their
connections can take from this thread (an idle plain TCP connection: ``items.offer``), and
posts the rest back to trio with one ``run_sync_soon``, never waiting on trio; when every
reply went out and nothing on the trio side waits for the batch (``Writer._wants_trio``),
it posts nothing. A batch of plain submits alone is one statement that SQLite commits on
its own (``Op.run_alone``). The items of one batch were all sent
before any of their replies, so any order of them is valid: the batch runs grouped by op,
in the ops' ``phase`` order (leases first), each op's items as they came. See
docs/architecture.md, "The writer thread". A batch whose writes the database refuses (a
disk full or failing, a lost PostgreSQL connection: relay/store/failures.py) keeps nothing
and is answered ``unavailable`` (``_unavailable``); a lost connection is made again before
the next batch (``_reconnect``). See docs/failure-model.md. The passes that run a batch
are relay/store/passes.py.

Lease recovery at start (``recover``, SQLite: the leases of the process that had the file
before are orphans) is the thread's first write, in a transaction of its own. If the disk
refuses it, the server still starts: every batch tries it again first and, while it cannot
commit, is answered as a batch the disk refused (reads served, writes ``unavailable``), and
the thread tries it again every RECOVERY_RETRY_S when idle. So nothing commits before it:
no lease is granted, renewed or acked that the recovery would then take back.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import trio

from relay.protocol.errors import InternalError, RelayError, ShuttingDown, StoreError, Unavailable
from relay.store import passes
from relay.store.base import Changes, Store
from relay.store.failures import RECONNECT_MAX_S, RECONNECT_S, store_error
from relay.store.items import Item, deliver, offer
from relay.util.log import event

log = logging.getLogger("relay.writer")
server_log = logging.getLogger("relay.server")

# While the lease recovery at start cannot commit (the disk is full), the idle thread tries
# it again this often (each batch tries it first too).
RECOVERY_RETRY_S = 1.0

# The items waiting for a batch, per sink (a connection), in turn order (the next to serve
# first), each sink's in the order they came.
Pending = OrderedDict[int, list[Item]]


def add_pending(pending: Pending, item: Item) -> list[Item]:
    """Add ``item`` to its sink's pending items; returns that sink's list."""
    mine = pending.get(id(item[1]))
    if mine is None:
        mine = pending[id(item[1])] = [item]
    else:
        mine.append(item)
    return mine


def take_batch(pending: Pending, max_batch: int, max_share: int) -> list[Item]:
    """The next batch: at most ``max_batch`` items, the sinks taking turns (each gets an
    even part of the room left, in passes, until the room or the items run out), and
    each sink's items, in order, weighing at most ``max_share`` in all (``Op.weigh``: the
    jobs a request touches; at least one item). A sink that reaches its share waits for
    the next batch, behind the others. So one connection's heavy requests (a
    ``submit_batch`` or an ``ack_batch`` of 1,000) delay another's by at most one of them,
    and its many light ones by at most an even part of a batch."""
    batch: list[Item] = []
    room = max_batch
    spent: dict[int, int] = {}
    done: list[tuple[int, list[Item]]] = []  # reached their share: after the others
    while room and pending:
        turns = len(pending)
        each = max(1, room // turns)
        for _ in range(turns):
            if not room:
                break
            key, mine = pending.popitem(last=False)
            used = spent.get(key, 0)
            limit = min(each, room, len(mine))
            n = 0
            for item in mine:
                weigh = item[0].weigh
                used += 1 if weigh is None else weigh(item[4])
                n += 1
                if n == limit or used >= max_share:
                    break
            if n == len(mine):
                batch += mine
                mine = []
            else:
                batch += mine[:n]
                del mine[:n]
            room -= n
            spent[key] = used
            if mine:
                if used < max_share:
                    pending[key] = mine  # its turn comes again after the others'
                else:
                    done.append((key, mine))
    for key, mine in done:
        pending[key] = mine
    return batch


class WriterBooks(Protocol):
    """What the thread reads and counts in its ``Writer`` (relay/store/writer.py): the
    inbox, the commit listeners, and the books the trio side reads (see there)."""

    inbox: queue.SimpleQueue[Item | None]
    commit_listeners: list[Callable[[Changes], None]]
    recording: bool
    recovering: bool
    _done_now: int
    _handed: int
    _handed_done: int

    def _answered(self, n: int) -> None: ...
    def _record(self, n: int, seconds: float | None, store_error: str | None) -> None: ...
    def _wants_trio(self, changes: Changes | None) -> bool: ...
    def _close(self) -> None: ...


class WriterThread:
    """Owns the store from start to close: ``run`` is the thread's body."""

    def __init__(
        self,
        store: Store,
        writer: WriterBooks,
        clock: Callable[[], int],
        max_batch: int,
        max_share: int,
        recover: bool = False,
    ) -> None:
        self.store = store
        self.writer = writer
        self.clock = clock
        self.max_batch = max_batch
        self.max_share = max_share
        # Items taken from the inbox that no batch has taken yet (take_batch).
        self.pending: Pending = OrderedDict()
        self.token = trio.lowlevel.current_trio_token()
        self.finished = trio.Event()
        # The store error episode under way (disk full, I/O errors): its kind, when it
        # began (perf_counter) and its failed batches. Logged once as it starts and once
        # as commits succeed again, not per batch. (Writer thread only.)
        self.episode: str | None = None
        self.episode_began = 0.0
        self.episode_failures = 0
        # A lost database connection: when to try to connect again, and the wait after.
        self.reconnect_at = 0.0
        self.reconnect_wait = RECONNECT_S
        # The lease recovery at start has yet to commit (``_recover``); since when it has
        # been refused (perf_counter; None: not refused yet).
        self.recovering = recover and store.recovers_on_start
        writer.recovering = self.recovering  # (read by the server's readiness, /healthz)
        self.recovery_refused_at: float | None = None
        # Set (trio thread) once the first try of the recovery is over, either way.
        self.first_recovery = trio.Event()

    # -- the trio side (called with run_sync_soon) -------------------------------------------

    def _delivered(self, pairs: list, woken: list, changes: Changes | None) -> None:
        writer = self.writer
        try:
            writer._answered(len(pairs))
            deliver(pairs, handed=True)
            for sink in woken:  # (their replies went out from the writer thread)
                try:
                    sink.after_now()
                except Exception:
                    log.exception("a reply sink failed after the writer wrote its replies")
            # Wake-ups after replies: a long-poll that a reply of this very batch parks is
            # registered by then, so a job made ready in the same batch still wakes it.
            if changes is not None:
                for listener in writer.commit_listeners:
                    try:
                        listener(changes)
                    except Exception:
                        log.exception("a commit listener failed")
        finally:
            # Last: until now the trio side (a long-poll parked above, say) lagged.
            writer._handed_done += 1

    def _stopped(self, in_hand: list[Item], crashed: bool) -> None:
        writer = self.writer
        writer._close()
        # Also what was queued but never taken, if the thread died first.
        while True:
            try:
                item = writer.inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                in_hand.append(item)
        error: RelayError = InternalError("not committed: writer crashed")
        if not crashed:
            error = ShuttingDown("the store has stopped")
        writer._answered(len(in_hand))
        deliver([(item, item[0].reply(item, error)) for item in in_hand])
        self.first_recovery.set()  # (if the thread stopped before its first try was over)
        self.finished.set()

    # -- the writer thread -------------------------------------------------------------------

    def run(self) -> None:
        inbox = self.writer.inbox
        pending = self.pending
        batch: list[Item] = []
        crashed = False
        more = True
        try:
            if self.recovering:
                self._recover()
            self.token.run_sync_soon(self.first_recovery.set)
            while more or pending:
                if not pending:
                    try:  # blocks only when there is no work (or a recovery to try again)
                        item = inbox.get(timeout=RECOVERY_RETRY_S if self.recovering else None)
                    except queue.Empty:
                        self._recover()
                        continue
                    if item is None:
                        break
                    add_pending(pending, item)
                # Everything else already waiting may join this transaction (group
                # commit), the connections taking turns (take_batch). (A connection's
                # items mostly come in runs: its list is at hand for the next one.)
                last: object = None
                mine: list[Item] = []
                while more:
                    try:
                        item = inbox.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        more = False  # the stop marker: after the items before it
                        break
                    if item[1] is last:
                        mine.append(item)
                    else:
                        last = item[1]
                        mine = add_pending(pending, item)
                batch = take_batch(pending, self.max_batch, self.max_share)
                done = self._execute(batch)
                batch = []  # (committed or answered: never answered again, see _stopped)
                self._finish(*done)
        except trio.RunFinishedError:
            log.warning("trio stopped before the writer was closed")
        except BaseException:
            log.exception("writer thread crashed")
            crashed = True
        finally:
            # Also what no batch took yet.
            batch += [item for items in pending.values() for item in items]
            pending.clear()
            try:
                # Closing with a transaction open rolls it back: nothing of `batch` is kept.
                self.store.close()
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    self.token.run_sync_soon(self._stopped, batch, crashed)

    def _finish(
        self, pairs: list, changes: Changes | None, seconds: float | None, failure: str | None
    ) -> None:
        """After the commit (or its failure): record the batch, write the replies that
        connections can take from this thread (``offer``), and hand the rest, and what
        the trio side must hear of, to the trio thread: one ``run_sync_soon``, or none
        when every reply went out and nothing there waits for this batch."""
        writer = self.writer
        writer._record(len(pairs), seconds, failure)
        rest, woken = offer(pairs)
        # Counted before asking who waits (_wants_trio): a sender that begins to wait for
        # room meanwhile has said so first, so one of the two sees the other.
        writer._done_now += len(pairs) - len(rest)
        try:
            wanted = bool(rest or woken) or writer._wants_trio(changes)
        except Exception:  # (some replies are out: nothing here may stop the hand-off)
            log.exception("asking who waits for a commit failed; it is handed over")
            wanted = True
        if wanted:
            writer._handed += 1
            self.token.run_sync_soon(self._delivered, rest, woken, changes)

    def _execute(self, batch: list[Item]) -> tuple[list, Changes | None, float | None, str | None]:
        """Run ``batch`` in one transaction; the (item, reply) pairs, what changed, how
        long it took (None: not committed), and the kind of store error that stopped its
        commit (None: it committed, or failed otherwise)."""
        store = self.store
        started = time.perf_counter()
        now = self.clock()
        if store.broken:
            try:
                self._reconnect(started)
            except Exception as exc:
                return self._unavailable(batch, [], now, exc)
        # Once per batch, so that a batch records all its state changes or none (a watcher
        # that starts meanwhile sees whole batches from the next one on).
        store.recording = self.writer.recording
        runs = passes.runs_of(batch)
        if self.recovering and (refused := self._recover()) is not None:
            return self._unavailable(batch, runs, now, refused)
        written = store.write_mark()[0]
        # (Never inside a transaction left open: its commit would be the one that counts.)
        if len(runs) == 1 and runs[0][0].run_alone is not None and not store.in_transaction:
            try:
                outcomes = passes.apply_alone(store, batch, runs[0][0], now)
            except Exception as exc:  # only a store error: the disk refused it, nothing written
                # (All its items are submits: none has an answer without writing.)
                return self._unavailable(batch, [], now, exc)
            if outcomes is not None:
                seconds = time.perf_counter() - started
                self._written(written)
                return passes.replies(batch, outcomes), store.take_changes(), seconds, None
        try:
            store.begin()
            outcomes = passes.apply_fast(store, batch, runs, now)
            if outcomes is None:
                # Start over, carefully: nothing of the first pass stands.
                store.rollback()
                store.begin()
                outcomes = passes.apply_careful(store, batch, runs, now)
            changes = store.commit()
        except Exception as exc:
            store.rollback()
            if store_error(exc) is not None:
                return self._unavailable(batch, runs, now, exc)
            log.exception("transaction of %d items failed; none is committed", len(batch))
            error = InternalError(f"not committed: {type(exc).__name__}: {exc}")
            return [(item, item[0].reply(item, error)) for item in batch], None, None, None
        seconds = time.perf_counter() - started
        self._written(written)
        return passes.replies(batch, outcomes), changes, seconds, None

    def _unavailable(
        self, batch: list[Item], runs: list, now: int, exc: Exception
    ) -> tuple[list, None, None, str]:
        """The answers to a batch whose writes the disk refused (``exc``: SQLITE_FULL,
        SQLITE_IOERR_*); nothing of it was kept, the counts included (rolled back with it).
        Every item that writes is answered ``unavailable``; the others (reads, refusals,
        repeats) get their own answers (``passes.apply_unwritten``): a full disk stops writes,
        not reads."""
        kind, description = self._refused(exc)
        self.episode_failures += 1
        error = Unavailable(f"not committed: {description}; retry later")
        outcomes = passes.apply_unwritten(self.store, batch, runs, now, error)
        pairs = passes.replies(batch, outcomes)
        return pairs, None, None, kind

    def _refused(self, exc: Exception) -> tuple[str, str]:
        """The store error ``exc`` (kind, description), logged if it begins an episode."""
        found = store_error(exc)
        assert found is not None, "only for store errors"
        kind = found[0]
        if self.episode != kind:
            event(
                log, logging.WARNING, "store.unavailable", kind=kind,
                error=f"{getattr(exc, 'sqlite_errorname', type(exc).__name__)}: {exc}",
            )  # fmt: skip
            if self.episode is None:
                self.episode_began = time.perf_counter()
            self.episode = kind
        return found

    def _recover(self) -> Exception | None:
        """Give the leases of the previous process back (``Store.leases_recover``), in a
        transaction of its own, before any other write. None once it has committed; else
        the store error that refused it (the disk is full), for the batch to be answered as
        the disk refused it; the recovery is then tried again. Any other error is a bug: it
        stops the thread (and the server)."""
        store = self.store
        started = time.perf_counter()
        written = store.write_mark()[0]
        try:
            store.begin()
            store.recording = self.writer.recording
            count = store.leases_recover(self.clock())
            changes = store.commit()
        except Exception as exc:
            store.rollback()
            if store_error(exc) is None:
                raise
            self._refused(exc)
            if self.recovery_refused_at is None:
                self.recovery_refused_at = started
                event(
                    server_log, logging.WARNING, "server.recovery_pending",
                    message="the leases of the previous run cannot be recovered yet (the "
                    "disk refuses the write): every write is answered unavailable until "
                    f"they are; retrying every {RECOVERY_RETRY_S:g} s",
                )  # fmt: skip
            return exc
        self.recovering = self.writer.recovering = False
        self._written(written)
        fields = {"count": count, "ms": round((time.perf_counter() - started) * 1000)}
        if self.recovery_refused_at is not None:
            fields["pending_s"] = round(started - self.recovery_refused_at, 3)
        if count or self.recovery_refused_at is not None:
            event(server_log, logging.WARNING, "server.recovered_leases", **fields)
        # Their jobs are ready now: whoever waits on those queues is told (a long-poll).
        try:
            wanted = self.writer._wants_trio(changes)
        except Exception:
            log.exception("asking who waits for the recovery failed; it is handed over")
            wanted = True
        if wanted:
            self.writer._handed += 1
            self.token.run_sync_soon(self._delivered, [], [], changes)
        return None

    def _reconnect(self, at: float) -> None:
        """Connect again (PostgreSQL), at most once per wait (doubling up to
        RECONNECT_MAX_S); raises while it cannot. In between, batches are answered
        ``unavailable`` at once."""
        if at < self.reconnect_at:
            raise StoreError("database", "reconnecting; retry later")
        self.reconnect_at = at + self.reconnect_wait
        self.reconnect_wait = min(self.reconnect_wait * 2, RECONNECT_MAX_S)
        self.store.reconnect()
        self.reconnect_wait = RECONNECT_S
        event(log, logging.INFO, "store.reconnected")

    def _written(self, before: int) -> None:
        """After a commit: one that wrote ends the store error episode, if one is under
        way (a commit that wrote nothing proves nothing about the disk)."""
        if self.episode is not None and self.store.write_mark()[0] != before:
            event(
                log, logging.INFO, "store.available", kind=self.episode,
                failed_batches=self.episode_failures,
                seconds=round(time.perf_counter() - self.episode_began, 3),
            )  # fmt: skip
            self.episode = None
            self.episode_failures = 0
