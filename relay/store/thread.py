"""The writer thread's body: batches, the passes that run them, commits, and the hand-off.

The thread takes every item already queued (up to ``max_batch``) and runs them in one
transaction, commits once, makes the replies, and posts them back to trio with one
``run_sync_soon``, never waiting on trio; a batch of plain submits alone is one statement
that SQLite commits on its own (``Op.run_alone``). The items of one batch were all sent
before any of their replies, so any order of them is valid: the batch runs grouped by op,
in the ops' ``phase`` order (leases first), each op's items as they came. See
docs/architecture.md, "The writer thread". A batch whose writes the database refuses (a
disk full or failing, a lost PostgreSQL connection: relay/store/failures.py) keeps nothing
and is answered ``unavailable`` (``_unavailable``); a lost connection is made again before
the next batch (``_reconnect``). See docs/failure-model.md.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from relay.errors import InternalError, RelayError, ShuttingDown, StoreError, Unavailable
from relay.log import event
from relay.store.base import Changes, Store
from relay.store.failures import RECONNECT_MAX_S, RECONNECT_S, store_error
from relay.store.items import Item, Op, deliver

if TYPE_CHECKING:
    from relay.store.writer import Writer

log = logging.getLogger("relay.writer")


class WriterThread:
    """Owns the store from start to close: ``run`` is the thread's body."""

    def __init__(
        self, store: Store, writer: Writer, clock: Callable[[], int], max_batch: int
    ) -> None:
        self.store = store
        self.writer = writer
        self.clock = clock
        self.max_batch = max_batch
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

    # -- the trio side (called with run_sync_soon) -------------------------------------------

    def _delivered(
        self, pairs: list, changes: Changes | None, seconds: float | None, failure: str | None
    ) -> None:
        self.writer._answered(len(pairs), seconds, failure)
        deliver(pairs)
        # Wake-ups after replies: a long-poll that a reply of this very batch parks is
        # registered by then, so a job made ready in the same batch still wakes it.
        if changes is not None:
            for listener in self.writer.commit_listeners:
                try:
                    listener(changes)
                except Exception:
                    log.exception("a commit listener failed")

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
        writer.queued -= len(in_hand)
        deliver([(item, item[0].reply(item, error)) for item in in_hand])
        self.finished.set()

    # -- the writer thread -------------------------------------------------------------------

    def run(self) -> None:
        inbox = self.writer.inbox
        batch: list[Item] = []
        crashed = False
        more = True
        try:
            while more:
                item = inbox.get()  # blocks only when there is no work
                if item is None:
                    break
                batch = [item]
                # Everything else already waiting joins this transaction (group commit).
                while len(batch) < self.max_batch:
                    try:
                        item = inbox.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        more = False  # the stop marker: after this batch
                        break
                    batch.append(item)
                pairs, changes, seconds, failure = self._execute(batch)
                self.token.run_sync_soon(self._delivered, pairs, changes, seconds, failure)
                batch = []
        except trio.RunFinishedError:
            log.warning("trio stopped before the writer was closed")
        except BaseException:
            log.exception("writer thread crashed")
            crashed = True
        finally:
            try:
                # Closing with a transaction open rolls it back: nothing of `batch` is kept.
                self.store.close()
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    self.token.run_sync_soon(self._stopped, batch, crashed)

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
        runs = _runs(batch)
        written = store.write_mark()[0]
        # (Never inside a transaction left open: its commit would be the one that counts.)
        if len(runs) == 1 and runs[0][0].run_alone is not None and not store.in_transaction:
            try:
                outcomes = self._apply_alone(batch, runs[0][0], now)
            except Exception as exc:  # only a store error: the disk refused it, nothing written
                # (All its items are submits: none has an answer without writing.)
                return self._unavailable(batch, [], now, exc)
            if outcomes is not None:
                seconds = time.perf_counter() - started
                self._written(written)
                pairs = [(item, _reply(item, o)) for item, o in zip(batch, outcomes, strict=True)]
                return pairs, store.take_changes(), seconds, None
        try:
            store.begin()
            outcomes = self._apply_fast(batch, runs, now)
            if outcomes is None:
                # Start over, carefully: nothing of the first pass stands.
                store.rollback()
                store.begin()
                outcomes = self._apply_careful(batch, runs, now)
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
        pairs = [
            (item, _reply(item, outcome)) for item, outcome in zip(batch, outcomes, strict=True)
        ]
        return pairs, changes, seconds, None

    def _unavailable(
        self, batch: list[Item], runs: list, now: int, exc: Exception
    ) -> tuple[list, None, None, str]:
        """The answers to a batch whose writes the disk refused (``exc``: SQLITE_FULL,
        SQLITE_IOERR_*); nothing of it was kept, the counts included (rolled back with it).
        Every item that writes is answered ``unavailable``; the others (reads, refusals,
        repeats) get their own answers (``_apply_unwritten``): a full disk stops writes,
        not reads."""
        found = store_error(exc)
        assert found is not None, "only for store errors"
        kind, description = found
        if self.episode != kind:
            event(
                log, logging.WARNING, "store.unavailable", kind=kind,
                error=f"{getattr(exc, 'sqlite_errorname', type(exc).__name__)}: {exc}",
            )  # fmt: skip
            if self.episode is None:
                self.episode_began = time.perf_counter()
            self.episode = kind
        self.episode_failures += 1
        error = Unavailable(f"not committed: {description}; retry later")
        outcomes = self._apply_unwritten(batch, runs, now, error)
        pairs = [(item, _reply(item, o)) for item, o in zip(batch, outcomes, strict=True)]
        return pairs, None, None, kind

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

    def _apply_alone(self, batch: list[Item], op: Op, now: int) -> list[Any] | None:
        """The outcomes of a batch that one statement committed on its own, or None (it
        wrote nothing: the batch takes the transaction's path, where each item gets its
        own answer). Whether it wrote is checked, not assumed: a batch that failed after
        its statement committed is never run again (its jobs would be made twice)."""
        mark = self.store.write_mark()
        try:
            return op.run_alone(self.store, now, [item[4] for item in batch])
        except Exception as exc:
            if self.store.write_mark() != mark:
                log.exception("a batch failed after its statement committed")
                # Its counts may not have moved (outside a transaction nothing is
                # journaled): count again from the table.
                self.store.recount()
                error = InternalError("committed, but no reply could be made; see the log")
                return [error] * len(batch)
            if store_error(exc) is not None:
                raise  # the disk refused it: a transaction would fare no better
            log.debug("a batch could not run alone; it runs in a transaction", exc_info=True)
            return None

    def _apply_fast(self, batch: list[Item], runs: list, now: int) -> list[Any] | None:
        """The batch's outcomes (by position), run without savepoints; None if an item
        failed in a way that may have left part of its change behind (the caller then
        starts over).

        Why: SAVEPOINT and RELEASE are statements, and each statement costs the thread a
        wait for the GIL. They are only needed when a command fails halfway, and a refusal
        never does: the store refuses before it writes (``Store``, relay/store/base.py).
        That is checked here, not assumed: a refusal after which the transaction has written
        rows or moved counters sends the batch to the careful path, as does any other error.
        """
        store = self.store
        outcomes: list[Any] = [None] * len(batch)
        for op, indexes in runs:
            if len(indexes) > 1:
                mark = store.write_mark()
                try:
                    merged = op.run_many(store, now, [batch[i][4] for i in indexes])
                except (RelayError, ValueError):
                    # A refusal in the run (or a job twice in one run of acks): each of
                    # its items on its own, for its own answer.
                    if store.write_mark() != mark:
                        return None
                except Exception as exc:
                    if store_error(exc) is not None:
                        raise  # nothing of the batch can commit: no second pass
                    log.warning("a merged run failed; the batch runs again", exc_info=True)
                    return None
                else:
                    for i, outcome in zip(indexes, merged, strict=True):
                        outcomes[i] = outcome
                    continue
            for i in indexes:
                mark = store.write_mark()
                try:
                    outcomes[i] = op.run(store, now, batch[i][4])
                except RelayError as exc:
                    if store.write_mark() != mark:
                        return None
                    outcomes[i] = exc
                except Exception as exc:
                    if store_error(exc) is not None:
                        raise
                    log.warning("an item failed; the batch runs again", exc_info=True)
                    return None
        return outcomes

    def _apply_careful(self, batch: list[Item], runs: list, now: int) -> list[Any]:
        """The batch's outcomes, each item (or merged run) in its own savepoint, so that a
        failure undoes exactly that item's changes."""
        store = self.store
        outcomes: list[Any] = [None] * len(batch)
        for op, indexes in runs:
            if len(indexes) > 1:
                try:
                    with store.command():
                        merged = op.run_many(store, now, [batch[i][4] for i in indexes])
                except Exception as exc:
                    if store_error(exc) is not None:
                        raise  # the whole batch is answered unavailable
                    self._check_transaction()
                else:
                    for i, outcome in zip(indexes, merged, strict=True):
                        outcomes[i] = outcome
                    continue
            for i in indexes:
                try:
                    with store.command():
                        outcomes[i] = op.run(store, now, batch[i][4])
                except RelayError as exc:
                    outcomes[i] = exc
                except Exception as exc:
                    if store_error(exc) is not None:
                        raise
                    log.exception("item %r failed", op.name)
                    outcomes[i] = InternalError(f"{type(exc).__name__}: {exc}")
                self._check_transaction()
        return outcomes

    def _apply_unwritten(
        self, batch: list[Item], runs: list, now: int, error: Unavailable
    ) -> list[Any]:
        """The outcomes of a batch that could not commit: each item run again on its own, in
        a savepoint, on what is committed; an item that wrote nothing (a read, a refusal, a
        repeated ack, a duplicate submit) keeps its answer, which does not depend on the
        disk; an item that wrote (or failed) is undone and answered ``error``, as is every
        item if the commit of nothing at the end fails too."""
        store = self.store
        outcomes: list[Any] = [error] * len(batch)
        if not runs:
            return outcomes
        try:
            store.begin()
            for op, indexes in runs:
                for i in indexes:
                    with contextlib.suppress(Exception):
                        outcomes[i] = self._unwritten(op, now, batch[i][4])
                    if not store.in_transaction:
                        # SQLite rolled it all back (the disk again). Nothing of it was
                        # to stand anyway: go on in a new one, or later items would each
                        # commit on their own.
                        store.rollback()
                        store.begin()
            store.commit()
        except Exception:
            store.rollback()
            return [error] * len(batch)
        return outcomes

    def _unwritten(self, op: Op, now: int, args: Any) -> Any:
        """``op.run``'s outcome (or refusal) if it writes nothing; else undone, and raises."""
        store = self.store
        with store.command():
            mark = store.write_mark()
            try:
                outcome = op.run(store, now, args)
            except RelayError as exc:
                outcome = exc
            if store.write_mark() != mark:
                raise _Wrote
        return outcome

    def _check_transaction(self) -> None:
        # On some errors (SQLITE_FULL, IOERR, NOMEM) SQLite rolls back the whole
        # transaction. Running on would commit each later item on its own (autocommit)
        # while the batch is answered "not committed": stop the batch instead.
        if not self.store.in_transaction:
            raise sqlite3.OperationalError("SQLite rolled the transaction back")


class _Wrote(Exception):
    """An item of a batch that could not commit wrote when run again: undo it."""


def _runs(batch: list[Item]) -> list[tuple[Any, list[int]]]:
    """The batch as runs of positions: the items of an op that has ``run_many`` as one
    run, every other item alone; ops in ``phase`` order, each op's items as they came."""
    first = batch[0][0]
    if first.run_many is not None and all(item[0] is first for item in batch):
        return [(first, list(range(len(batch))))]  # the common batch: one kind of request
    by_op: dict[Any, list[int]] = {}
    for i, item in enumerate(batch):
        positions = by_op.get(item[0])
        if positions is None:
            by_op[item[0]] = [i]
        else:
            positions.append(i)
    runs: list[tuple[Any, list[int]]] = []
    for op in sorted(by_op, key=_phase):
        positions = by_op[op]
        if op.run_many is not None:
            runs.append((op, positions))
        else:
            runs += [(op, [i]) for i in positions]
    return runs


def _phase(op: Op) -> int:
    return op.phase


def _reply(item: Item, outcome: Any) -> Any:
    try:
        return item[0].reply(item, outcome)
    except Exception:
        log.exception("making the reply of %r failed", item[0].name)
        return item[0].reply(item, InternalError("internal error; the server logged it"))
