"""The writer thread's body: batches, the passes that run them, commits, and the hand-off.

The thread takes every item already queued (up to ``max_batch``) and runs them in one
transaction, commits once, makes the replies, and posts them back to trio with one
``run_sync_soon``, never waiting on trio; a batch of plain submits alone is one statement
that SQLite commits on its own (``Op.run_alone``). The items of one batch were all sent
before any of their replies, so any order of them is valid: the batch runs grouped by op,
in the ops' ``phase`` order (leases first), each op's items as they came. See
docs/architecture.md, "The writer thread".
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

from relay.errors import InternalError, RelayError, ShuttingDown
from relay.store.items import Item, Op, deliver
from relay.store.sqlite import Changes, SqliteStore

if TYPE_CHECKING:
    from relay.store.writer import Writer

log = logging.getLogger("relay.writer")


class WriterThread:
    """Owns the store from start to close: ``run`` is the thread's body."""

    def __init__(
        self, store: SqliteStore, writer: Writer, clock: Callable[[], int], max_batch: int
    ) -> None:
        self.store = store
        self.writer = writer
        self.clock = clock
        self.max_batch = max_batch
        self.token = trio.lowlevel.current_trio_token()
        self.finished = trio.Event()

    # -- the trio side (called with run_sync_soon) -------------------------------------------

    def _delivered(self, pairs: list, changes: Changes | None, seconds: float | None) -> None:
        self.writer._answered(len(pairs), seconds)
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
                pairs, changes, seconds = self._execute(batch)
                self.token.run_sync_soon(self._delivered, pairs, changes, seconds)
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

    def _execute(self, batch: list[Item]) -> tuple[list, Changes | None, float | None]:
        """Run ``batch`` in one transaction; the (item, reply) pairs, what changed, and how
        long it took (None: not committed)."""
        store = self.store
        started = time.perf_counter()
        now = self.clock()
        runs = _runs(batch)
        # (Never inside a transaction left open: its commit would be the one that counts.)
        if len(runs) == 1 and runs[0][0].run_alone is not None and not store.in_transaction:
            outcomes = self._apply_alone(batch, runs[0][0], now)
            if outcomes is not None:
                seconds = time.perf_counter() - started
                pairs = [(item, _reply(item, o)) for item, o in zip(batch, outcomes, strict=True)]
                return pairs, store.take_changes(), seconds
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
            log.exception("transaction of %d items failed; none is committed", len(batch))
            store.rollback()
            error = InternalError(f"not committed: {type(exc).__name__}: {exc}")
            return [(item, item[0].reply(item, error)) for item in batch], None, None
        seconds = time.perf_counter() - started
        pairs = [
            (item, _reply(item, outcome)) for item, outcome in zip(batch, outcomes, strict=True)
        ]
        return pairs, changes, seconds

    def _apply_alone(self, batch: list[Item], op: Op, now: int) -> list[Any] | None:
        """The outcomes of a batch that one statement committed on its own, or None (it
        wrote nothing: the batch takes the transaction's path, where each item gets its
        own answer). Whether it wrote is checked, not assumed: a batch that failed after
        its statement committed is never run again (its jobs would be made twice)."""
        mark = self.store.write_mark()
        try:
            return op.run_alone(self.store, now, [item[4] for item in batch])
        except Exception:
            if self.store.write_mark() != mark:
                log.exception("a batch failed after its statement committed")
                # Its counts may not have moved (outside a transaction nothing is
                # journaled): count again from the table.
                self.store.recount()
                error = InternalError("committed, but no reply could be made; see the log")
                return [error] * len(batch)
            log.debug("a batch could not run alone; it runs in a transaction", exc_info=True)
            return None

    def _apply_fast(self, batch: list[Item], runs: list, now: int) -> list[Any] | None:
        """The batch's outcomes (by position), run without savepoints; None if an item
        failed in a way that may have left part of its change behind (the caller then
        starts over).

        Why: SAVEPOINT and RELEASE are statements, and each statement costs the thread a
        wait for the GIL. They are only needed when a command fails halfway, and a refusal
        never does: the store refuses before it writes (relay/store/sqlite.py). That is
        checked here, not assumed: a refusal after which the transaction has written rows
        or moved counters sends the batch to the careful path, as does any other error.
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
                except Exception:
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
                except Exception:
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
                except Exception:
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
                    log.exception("item %r failed", op.name)
                    outcomes[i] = InternalError(f"{type(exc).__name__}: {exc}")
                self._check_transaction()
        return outcomes

    def _check_transaction(self) -> None:
        # On some errors (SQLITE_FULL, IOERR, NOMEM) SQLite rolls back the whole
        # transaction. Running on would commit each later item on its own (autocommit)
        # while the batch is answered "not committed": stop the batch instead.
        if not self.store.in_transaction:
            raise sqlite3.OperationalError("SQLite rolled the transaction back")


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
