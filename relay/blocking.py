"""A small blocking client for producers in synchronous programs (a web app that submits).

    with relay.connect("127.0.0.1:7400") as queue:
        queue.submit("email", {"to": "ada@example.com"})

One socket, one request at a time (a lock makes it safe to share between threads). A
dropped connection raises ``ConnectionLost`` for the call in flight (it may or may not
have taken effect: use an ``idempotency_key`` to make a resubmit safe); the next call
connects again.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
from collections.abc import Sequence
from typing import Any

import orjson

from relay.client import (
    CONNECT_TIMEOUT_S,
    DEFAULT_ADDRESS,
    JobView,
    Stats,
    job_fields,
    parse_address,
    reply_fields,
    structure_reply,
    submit_result,
)
from relay.errors import ConnectionLost
from relay.model import SubmitResult

READ_BYTES = 64 * 1024


class BlockingClient:
    def __init__(
        self,
        address: str | tuple[str, int] = DEFAULT_ADDRESS,
        *,
        timeout: float = 30.0,
        connect_timeout: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.address = parse_address(address)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._buffer = b""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._buffer = None, b""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=self.connect_timeout)
        sock.settimeout(self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and return the reply's fields, or raise its error."""
        with self._lock:
            if self._sock is not None and not self._alive(self._sock):
                self._drop()  # the server closed it while we were idle: nothing was lost
            if self._sock is None:
                self._sock = self._connect()
            request_id = next(self._ids)
            line = orjson.dumps({"op": op, "id": request_id, **fields}) + b"\n"
            try:
                self._sock.sendall(line)
                reply = self._read_reply(request_id)
            except OSError as exc:
                self._drop()
                raise ConnectionLost(f"{op}: {exc}") from None
        return reply_fields(reply)

    @staticmethod
    def _alive(sock: socket.socket) -> bool:
        """False if the server has closed the connection (a pending EOF or reset).

        Between requests nothing should be readable; if something is, peeking at it does
        not block (a socket with a timeout would wait out its timeout on an empty peek).
        """
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return not readable or sock.recv(1, socket.MSG_PEEK) != b""
        except (OSError, ValueError):
            return False

    def _read_reply(self, request_id: int) -> dict[str, Any]:
        assert self._sock is not None
        while True:
            while b"\n" not in self._buffer:
                data = self._sock.recv(READ_BYTES)
                if not data:
                    raise ConnectionResetError("the server closed the connection")
                self._buffer += data
            line, _, self._buffer = self._buffer.partition(b"\n")
            reply = orjson.loads(line)
            if reply.get("id") in (request_id, None):
                return reply

    def submit(self, queue: str, payload: Any, **options: Any) -> SubmitResult:
        """Create a job; ``options`` as for the async ``Client.submit``."""
        return submit_result(self.request("submit", **job_fields(queue, payload, **options)))

    def submit_batch(self, jobs: Sequence[dict[str, Any]]) -> list[SubmitResult]:
        reply = self.request("submit_batch", jobs=list(jobs))
        return [submit_result(r) for r in reply["results"]]

    def inspect(self, job_id: str) -> JobView:
        return structure_reply(self.request("inspect", job_id=job_id)["job"], JobView)

    def stats(self) -> Stats:
        return structure_reply(self.request("stats"), Stats)


def connect(address: str | tuple[str, int] = DEFAULT_ADDRESS, **options: Any) -> BlockingClient:
    """A blocking client; it connects on its first call."""
    return BlockingClient(address, **options)
