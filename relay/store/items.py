"""What passes between trio code and the writer thread: items, ops, and reply sinks.

An *item* is a plain tuple ``(op, sink, tag, started, args)``: the op says how the writer
runs ``args`` on the store (``run``, or ``run_many`` for all the batch's items of that op
in one call) and how the outcome becomes a reply (``reply``, in the writer thread, after
the commit); ``sink.deliver`` gets ``(item, reply)`` pairs in the trio thread; ``tag`` and
``started`` are the sink's (a request id and when it arrived, say). A tuple, not an
object, because one is made per request and the two threads share one GIL: every
microsecond the trio thread spends on a request is one the writer waits for.

The request ops are in relay/server/requests/ops.py; a typed command (relay/store/commands.py)
travels wrapped in a ``CommandOp``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from relay.store.base import Store
from relay.store.commands import Command

log = logging.getLogger("relay.writer")

# (op, sink, tag, started, args): see the module docstring.
Item = tuple[Any, Any, Any, float, Any]


class Op(Protocol):
    """How the writer runs one kind of item. Ops are a few module constants, not made per
    request. ``run_many`` (or None) runs many items' args in one call: it returns each
    one's outcome (an item's outcome may be the ``RelayError`` that refused it, having
    written nothing for it), or raises (a ``RelayError``, or ValueError) having written
    nothing at all, and the writer then runs them one by one."""

    name: str
    phase: int  # the batch runs ops in this order (lower first)
    run_many: Callable[[Store, int, list[Any]], list[Any]] | None
    # For a batch of this op alone: run it as one statement that commits on its own (no
    # BEGIN, no COMMIT: two waits for the GIL fewer), or return None having written
    # nothing. If it raises after its statement committed, the writer answers every item
    # ``internal`` and never runs them again (relay/store/thread.py).
    run_alone: Callable[[Store, int, list[Any]], list[Any] | None] | None
    # How much of a batch an item's args weigh: the jobs it touches (None: one), or a read
    # of up to thousands of rows a whole share (``whole_share``). One connection's items
    # weigh at most ``max_share`` in a batch (relay/store/thread.py).
    weigh: Callable[[Any], int] | None

    def run(self, store: Store, now: int, args: Any) -> Any: ...
    def reply(self, item: Item, outcome: Any) -> Any: ...  # writer thread, after commit


# What a read of up to thousands of rows weighs (a page of the job browser examines up to
# 10,000 jobs): more than any ``max_share``, so that it is its connection's whole share of
# a batch, as a submit_batch of 1,000 is: pipelined, they take turns with the others.
WHOLE_SHARE = 1 << 62


def whole_share(args: Any) -> int:
    """``Op.weigh`` of a read of up to thousands of rows, whatever its args."""
    return WHOLE_SHARE


class ReplySink(Protocol):
    """Where replies go. ``deliver`` runs in the trio thread, must not block, and gets the
    (item, reply) pairs of one batch for this sink, in the order they were sent.

    A sink may also have ``deliver_now`` (a connection that can write its replies from
    any thread): the writer thread offers it a batch's pairs first (``offer``), and it
    answers NOT_TAKEN (they go to ``deliver`` as usual), TAKEN (written, or dropped, and
    counted: nothing more to do) or TAKEN_WAKE (the same, but ``after_now`` must then run
    in the trio thread: someone there waits for what it took). The pairs it did not take
    come to its ``deliver_handed`` (if it has one) in the hand-off: until then it takes
    none of a later commit, so that a connection's replies go out in commit order."""

    def deliver(self, pairs: list[tuple[Item, Any]]) -> None: ...


NOT_TAKEN, TAKEN, TAKEN_WAKE = 0, 1, 2


class CommandOp:
    """The op of a typed command class: ``apply``, merged by ``apply_many`` if it has one;
    the reply is the outcome itself (a result, or the ``RelayError`` that refused it)."""

    name = "command"
    run_alone = None
    weigh = None

    def __init__(self, kind: type) -> None:
        self.phase = getattr(kind, "PHASE", 1)
        self.run_many = getattr(kind, "apply_many", None)

    @staticmethod
    def run(store: Store, now: int, command: Command) -> Any:
        return command.apply(store, now)

    @staticmethod
    def reply(item: Item, outcome: Any) -> Any:
        return outcome


_COMMAND_OPS: dict[type, CommandOp] = {}


def command_op(command: Command) -> CommandOp:
    kind = type(command)
    op = _COMMAND_OPS.get(kind)
    if op is None:
        op = _COMMAND_OPS[kind] = CommandOp(kind)
    return op


_NO_SINK = object()  # (what no pair's sink is: a None sink is grouped like any other)


def by_sink(pairs: list[tuple[Item, Any]]) -> list[tuple[Any, list[tuple[Item, Any]]]]:
    """``pairs`` grouped by sink (``item[1]``), in order of first appearance, each sink's
    pairs in order."""
    groups: dict[int, tuple[Any, list[tuple[Item, Any]]]] = {}
    last: Any = _NO_SINK
    mine: list[tuple[Item, Any]] = []
    for pair in pairs:
        sink = pair[0][1]
        if sink is not last:  # (a connection's items mostly come in runs)
            entry = groups.get(id(sink))
            if entry is None:
                entry = groups[id(sink)] = (sink, [])
            last, mine = sink, entry[1]
        mine.append(pair)
    return list(groups.values())


def deliver(pairs: list[tuple[Item, Any]], *, handed: bool = False) -> None:
    """Hand each sink its pairs, in order; a failing sink does not stop the others.
    ``handed``: these are a commit's hand-off, the pairs ``offer`` left (a sink that has
    ``deliver_handed`` takes them there)."""
    for sink, mine in by_sink(pairs):
        try:
            if handed and hasattr(sink, "deliver_handed"):
                sink.deliver_handed(mine)
            else:
                sink.deliver(mine)
        except Exception:
            log.exception("a reply sink failed; the other replies are delivered")


def offer(pairs: list[tuple[Item, Any]]) -> tuple[list[tuple[Item, Any]], list[Any]]:
    """Writer thread: offer each sink that has ``deliver_now`` its pairs of this batch.
    Returns the pairs left for ``deliver`` (in order) and the sinks whose ``after_now``
    must run in the trio thread."""
    groups = by_sink(pairs)
    if len(groups) == 1 and getattr(groups[0][0], "deliver_now", None) is None:
        return pairs, []  # (a typed command's waiter, say)
    rest: list[tuple[Item, Any]] = []
    woken: list[Any] = []
    for sink, mine in groups:
        deliver_now = getattr(sink, "deliver_now", None)
        taken = NOT_TAKEN
        if deliver_now is not None:
            try:
                taken = deliver_now(mine)
            except Exception:
                log.exception("a reply sink failed to take its replies; the trio thread will")
        if taken == NOT_TAKEN:
            rest += mine
        elif taken == TAKEN_WAKE:
            woken.append(sink)
    return rest, woken
