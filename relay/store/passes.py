"""The passes that run one batch in the writer thread, given the store: alone (one
statement that commits on its own), fast (no savepoints), careful (a savepoint per item or
merged run), and unwritten (a batch the disk refused: what can be answered without
writing). Which pass runs when, and the commit, are the thread's (relay/store/thread.py);
see docs/architecture.md, "The writer thread".
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from typing import Any

from relay.protocol.errors import InternalError, RelayError, Unavailable
from relay.store.base import Store
from relay.store.failures import store_error
from relay.store.items import Item, Op

log = logging.getLogger("relay.writer")


def apply_alone(store: Store, batch: list[Item], op: Op, now: int) -> list[Any] | None:
    """The outcomes of a batch that one statement committed on its own, or None (it
    wrote nothing: the batch takes the transaction's path, where each item gets its
    own answer). Whether it wrote is checked, not assumed: a batch that failed after
    its statement committed is never run again (its jobs would be made twice)."""
    mark = store.write_mark()
    try:
        return op.run_alone(store, now, [item[4] for item in batch])
    except Exception as exc:
        if store.write_mark() != mark:
            log.exception("a batch failed after its statement committed")
            # Its counts may not have moved (outside a transaction nothing is
            # journaled): count again from the table.
            store.recount()
            error = InternalError("committed, but no reply could be made; see the log")
            return [error] * len(batch)
        if store_error(exc) is not None:
            raise  # the disk refused it: a transaction would fare no better
        log.debug("a batch could not run alone; it runs in a transaction", exc_info=True)
        return None


def apply_fast(store: Store, batch: list[Item], runs: list, now: int) -> list[Any] | None:
    """The batch's outcomes (by position), run without savepoints; None if an item
    failed in a way that may have left part of its change behind (the caller then
    starts over).

    Why: SAVEPOINT and RELEASE are statements, and each statement costs the thread a
    wait for the GIL. They are only needed when a command fails halfway, and a refusal
    never does: the store refuses before it writes (``Store``, relay/store/base.py).
    That is checked here, not assumed: a refusal after which the transaction has written
    rows or moved counters sends the batch to the careful path, as does any other error.
    (A merged run that answers some of its items with a refusal, a run of acks, vouches
    for those items itself: ``Store.jobs_ack_many`` refuses an ack only if it wrote
    nothing for it.)
    """
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


def apply_careful(store: Store, batch: list[Item], runs: list, now: int) -> list[Any]:
    """The batch's outcomes, each item (or merged run) in its own savepoint, so that a
    failure undoes exactly that item's changes."""
    outcomes: list[Any] = [None] * len(batch)
    for op, indexes in runs:
        if len(indexes) > 1:
            try:
                with store.command():
                    merged = op.run_many(store, now, [batch[i][4] for i in indexes])
            except Exception as exc:
                if store_error(exc) is not None:
                    raise  # the whole batch is answered unavailable
                check_transaction(store)
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
            check_transaction(store)
    return outcomes


def apply_unwritten(
    store: Store, batch: list[Item], runs: list, now: int, error: Unavailable
) -> list[Any]:
    """The outcomes of a batch that could not commit: each item run again on its own, in
    a savepoint, on what is committed; an item that wrote nothing (a read, a refusal, a
    repeated ack, a duplicate submit) keeps its answer, which does not depend on the
    disk; an item that wrote (or failed) is undone and answered ``error``, as is every
    item if the commit of nothing at the end fails too."""
    outcomes: list[Any] = [error] * len(batch)
    if not runs:
        return outcomes
    try:
        store.begin()
        for op, indexes in runs:
            for i in indexes:
                with contextlib.suppress(Exception):
                    outcomes[i] = _unwritten(store, op, now, batch[i][4])
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


def _unwritten(store: Store, op: Op, now: int, args: Any) -> Any:
    """``op.run``'s outcome (or refusal) if it writes nothing; else undone, and raises."""
    with store.command():
        mark = store.write_mark()
        try:
            outcome = op.run(store, now, args)
        except RelayError as exc:
            outcome = exc
        if store.write_mark() != mark:
            raise _Wrote
    return outcome


def check_transaction(store: Store) -> None:
    # On some errors (SQLITE_FULL, IOERR, NOMEM) SQLite rolls back the whole
    # transaction. Running on would commit each later item on its own (autocommit)
    # while the batch is answered "not committed": stop the batch instead.
    if not store.in_transaction:
        raise sqlite3.OperationalError("SQLite rolled the transaction back")


class _Wrote(Exception):
    """An item of a batch that could not commit wrote when run again: undo it."""


def runs_of(batch: list[Item]) -> list[tuple[Any, list[int]]]:
    """The batch as runs of positions: the items of an op that has ``run_many`` as one
    run, every other item alone; ops in ``phase`` order, each op's items as they came."""
    first = batch[0][0]
    if first.run_many is not None and all([item[0] is first for item in batch]):
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


def replies(batch: list[Item], outcomes: list[Any]) -> list[tuple[Item, Any]]:
    """The (item, reply) pair of each item, made by its op (after the commit). If making
    one fails (a bug), they are made again one by one, each failure answered on its own
    (a reply's side effect, a log line, may then happen twice)."""
    try:
        return [(item, item[0].reply(item, o)) for item, o in zip(batch, outcomes, strict=True)]
    except Exception:
        return [(item, reply(item, o)) for item, o in zip(batch, outcomes, strict=True)]


def reply(item: Item, outcome: Any) -> Any:
    try:
        return item[0].reply(item, outcome)
    except Exception:
        log.exception("making the reply of %r failed", item[0].name)
        return item[0].reply(item, InternalError("internal error; the server logged it"))
