"""Reloading the token file and the TLS certificate and key without a restart, on SIGHUP
or the admin op ``reload``.

A reload reads the files again (in a thread) and, for each that can be used, puts it in
force at once: a hello is checked against the new tokens, and a connection accepted from
then on shakes hands with the new pair. A file that cannot be used (unreadable, no token,
a bad line, a certificate that does not load) changes nothing of its part: the old
tokens or pair stay in force, and the reload logs one line naming the file and why.
Connections already authenticated with a token that is gone, or that now gives another
role, go on for the grace (``token_grace_ms``, 30 s by default), time for a client to
finish what it has in flight or to say hello again with its new token; after it, those
still stale take no more requests, get the replies they are owed, and are closed.
Connections already shaken hands keep their session over the old certificate.
"""

from __future__ import annotations

import logging
import signal
import ssl
import threading
from collections.abc import Sequence
from typing import Any

import trio

from relay.server.connections.listener import Listener
from relay.server.connections.tls import TlsConfigError, server_context
from relay.server.core import ServerConfig
from relay.server.requests.access import Access
from relay.server.requests.auth import AuthConfigError, Tokens, load_tokens
from relay.util.log import event

log = logging.getLogger("relay.server")


class Reloader:
    """The reloads of one server. ``run`` (in the transports nursery) takes SIGHUP and
    owns the tasks that close stale connections after the grace; ``reload`` is the work
    of one reload, for the signal and the op alike."""

    def __init__(self, config: ServerConfig, access: Access, listeners: Sequence[Listener]):
        self._config = config
        self._access = access
        self._listeners = listeners
        self._grace = config.token_grace_ms / 1000
        self._nursery: trio.Nursery | None = None
        self.reloads = 0  # done (each part that could be used was put in force)
        self.failures = 0  # parts that could not be used

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if threading.current_thread() is not threading.main_thread():
                task_status.started()  # signals reach the main thread only: the op alone
                await trio.sleep_forever()
            with trio.open_signal_receiver(signal.SIGHUP) as signals:
                task_status.started()
                async for _ in signals:
                    await self.reload("SIGHUP")

    async def reload(self, via: str) -> dict[str, Any]:
        """Read the files again and put in force each that can be used; the ``reload``
        op's reply: ``tokens`` (how many are in force; null without a token file), ``tls``
        (whether a new pair is in force), ``closing`` (connections to close after the
        grace), ``grace_ms``, and ``errors`` (one line for each file that could not be
        used, which changed nothing)."""
        config = self._config
        errors: list[str] = []
        tokens: Tokens | None = None
        context: ssl.SSLContext | None = None
        if config.auth_token_file is not None and self._access.tokens is not None:
            try:
                tokens = await trio.to_thread.run_sync(
                    load_tokens, config.auth_token_file, config.auth_env_token
                )
            except AuthConfigError as exc:
                errors.append(f"tokens kept: {exc}")
        if config.tls_cert is not None and config.tls_key is not None:
            try:
                context = await trio.to_thread.run_sync(
                    server_context, config.tls_cert, config.tls_key
                )
            except TlsConfigError as exc:
                errors.append(f"certificate kept: {exc}")
        closing = 0
        if tokens is not None:
            closing = self._access.use_tokens(tokens)
            if closing and self._nursery is not None:
                self._nursery.start_soon(self._close_stale)
        if context is not None:
            for listener in self._listeners:
                listener.use_tls(context)
        self.failures += len(errors)
        self.reloads += 1
        for error in errors:
            event(log, logging.WARNING, "reload.failed", via=via, error=error)
        current = self._access.tokens
        reply = {
            "tokens": None if config.auth_token_file is None or current is None else len(current),
            "tls": context is not None,
            "closing": closing,
            "grace_ms": config.token_grace_ms,
            "errors": errors,
        }
        event(log, logging.INFO, "reload.done", via=via, tokens=reply["tokens"],
              tls=reply["tls"], closing=closing, grace_ms=config.token_grace_ms,
              failed=len(errors))  # fmt: skip
        return reply

    async def _close_stale(self) -> None:
        """After the grace: close the connections whose token is still gone or of another
        role (one that said hello again with a valid token meanwhile stays)."""
        await trio.sleep(self._grace)
        for connection in self._access.stale():
            connection.revoke()
