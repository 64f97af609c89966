"""Submits and acks that many tasks make at once, sent as one request (``batch_window_ms``).

    async with relay.open_client(address, batch_window_ms=2) as client:
        await client.submit("email", {...})   # from each of 256 tasks

Calls made while no batch of theirs is in flight go at once, together with those made in
the same scheduler tick; calls made while one is in flight wait for it to be answered, or
for the window to pass, whichever comes first (group commit, as the server does): the
window bounds the latency added, and a lone call waits for nothing. A group goes as one
``submit_batch`` (acks of one worker as one ``ack_batch``), and each caller still gets its
own result or its own error. A batch the server refuses as a whole (one bad job, a full
queue, a frame too large) is sent again one request per call, so that each caller gets
the answer it would have had alone: a refused submit_batch commits nothing, and acks are
safe to repeat. A group is cut at ``MAX_ITEMS`` calls or ``MAX_BYTES`` of encoded jobs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import trio

from relay.protocol.errors import (
    BadRequest,
    ConnectionLost,
    FrameTooLarge,
    QueueFull,
    RelayError,
    error_from_wire,
)

# A group goes at once when it reaches either: at most the server's default max_batch,
# and half its default max_frame_bytes, so that a batch is never refused for its size.
MAX_ITEMS = 1000
MAX_BYTES = 512 * 1024
# Refusals that concern the batch as a whole, or one of its items: each call again alone.
_ONE_BY_ONE = (BadRequest, FrameTooLarge, QueueFull)

Request = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


class _Slot:
    """One caller's item and, once answered, its reply fields or error."""

    __slots__ = ("done", "encoded", "error", "fields", "reply", "size")

    def __init__(self, fields: dict[str, Any], encoded: bytes) -> None:
        self.fields, self.encoded = fields, orjson.Fragment(encoded)
        self.size = len(encoded)
        self.done = trio.Event()
        self.reply: Any = None
        self.error: BaseException | None = None

    def settle(self, reply: Any = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.reply, self.error = reply, error
            self.done.set()


class _Group:
    """The calls waiting to go together (the submits, or one worker's acks)."""

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.size = 0
        self.running = False
        self.in_flight = 0  # batches sent and not yet answered
        self.wake = trio.Event()  # full, or a batch answered


class Coalescer:
    """Owned by ``open_client``: its tasks live in the client's nursery."""

    def __init__(self, request: Request, window_s: float, nursery: trio.Nursery) -> None:
        self._request = request
        self._window = window_s
        self._nursery = nursery
        self._groups: dict[Any, _Group] = {}
        self._closed = False

    def close(self) -> None:
        """The client is closing: every call still waiting raises ConnectionLost, and so
        does any later one. (Calls in flight get it from their request.)"""
        self._closed = True
        for group in self._groups.values():
            for slot in group.slots:
                slot.settle(error=ConnectionLost("the client is closed"))
            group.slots.clear()
            group.size = 0

    async def submit(self, job: dict[str, Any]) -> dict[str, Any]:
        """The reply fields of one submit of ``job`` (as ``job_fields`` makes it)."""
        return await self._call("submit", orjson.dumps(job), job)

    async def ack(self, worker_id: str, item: dict[str, Any]) -> None:
        """Ack ``item`` ({job_id, token, result?}) for ``worker_id``; raises its refusal."""
        await self._call(("ack", worker_id), orjson.dumps(item), item)

    async def _call(self, key: Any, encoded: bytes, fields: dict[str, Any]) -> Any:
        if self._closed:
            raise ConnectionLost("the client is closed")
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group()
        slot = _Slot(fields, encoded)
        group.slots.append(slot)
        group.size += slot.size
        if len(group.slots) >= MAX_ITEMS or group.size >= MAX_BYTES:
            group.wake.set()
        if not group.running:
            group.running = True
            self._nursery.start_soon(self._run, key, group)
        try:
            await slot.done.wait()
        except trio.Cancelled:
            if slot in group.slots:  # not sent: it goes nowhere
                group.slots.remove(slot)
                group.size -= slot.size
            raise
        if slot.error is not None:
            raise slot.error
        return slot.reply

    async def _run(self, key: Any, group: _Group) -> None:
        """Send the group's calls until none is left: at once while none of its batches
        is in flight (this task runs after the tick that woke it, so that tick's calls
        are all here), else once one is answered, the group is full, or the window ends.
        """
        try:
            while group.slots:
                if group.in_flight:
                    with trio.move_on_after(self._window):
                        await group.wake.wait()
                taken, size = [], 0
                for slot in group.slots[:MAX_ITEMS]:
                    if taken and size + slot.size > MAX_BYTES:
                        break
                    taken.append(slot)
                    size += slot.size
                del group.slots[: len(taken)]
                group.size -= size
                if len(group.slots) < MAX_ITEMS and group.size < MAX_BYTES:
                    group.wake = trio.Event()
                group.in_flight += 1
                self._nursery.start_soon(self._send, key, group, taken)
        finally:
            group.running = False

    async def _send(self, key: Any, group: _Group, slots: list[_Slot]) -> None:
        try:
            if key == "submit":
                await self._send_submits(slots)
            else:
                await self._send_acks(key[1], slots)
        finally:
            # Cut short (the client is closing): no caller is left waiting.
            for slot in slots:
                slot.settle(error=ConnectionLost("the client is closed"))
            group.in_flight -= 1
            group.wake.set()

    async def _send_submits(self, slots: list[_Slot]) -> None:
        if len(slots) == 1:
            return await self._one_by_one("submit", slots)
        jobs = [slot.encoded for slot in slots]
        try:
            reply = await self._request("submit_batch", {"jobs": jobs})
        except _ONE_BY_ONE:
            return await self._one_by_one("submit", slots)
        except RelayError as exc:
            for slot in slots:
                slot.settle(error=exc)
            return
        for slot, result in zip(slots, reply["results"], strict=True):
            slot.settle(result)

    async def _send_acks(self, worker_id: str, slots: list[_Slot]) -> None:
        if len(slots) == 1:
            return await self._one_by_one("ack", slots, worker_id)
        acks = [slot.encoded for slot in slots]
        try:
            reply = await self._request("ack_batch", {"worker_id": worker_id, "acks": acks})
        except _ONE_BY_ONE:
            return await self._one_by_one("ack", slots, worker_id)
        except RelayError as exc:
            for slot in slots:
                slot.settle(error=exc)
            return
        for slot, r in zip(slots, reply["results"], strict=True):
            error = None if r["ok"] else error_from_wire(r["error"]["code"], r["error"]["message"])
            slot.settle(r, error)

    async def _one_by_one(self, op: str, slots: list[_Slot], worker_id: str | None = None) -> None:
        async def one(slot: _Slot) -> None:
            fields = slot.fields if worker_id is None else {**slot.fields, "worker_id": worker_id}
            try:
                slot.settle(await self._request(op, fields))
            except RelayError as exc:
                slot.settle(error=exc)

        async with trio.open_nursery() as nursery:
            for slot in slots:
                nursery.start_soon(one, slot)
