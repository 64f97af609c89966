"""``open_service_nursery``: a nursery for background services around a ``yield``.

trio wraps an exception raised in a nursery's body in an ExceptionGroup. Our context
managers (``open_client``, ``open_local``, ``open_core``, ``open_writer``) yield to their
caller inside a nursery that runs their background tasks, and promise not to raise
exception groups: the caller's own exception (``StaleToken``, ``KeyboardInterrupt``...)
must come out as itself. This helper catches the body's exception, cancels the services,
and raises it again outside the nursery.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


@asynccontextmanager
async def open_service_nursery() -> AsyncIterator[trio.Nursery]:
    """Yield a nursery for services; leaving the block cancels them.

    The services themselves must not raise (they would then come out grouped): each
    catches and logs its own errors.
    """
    body_error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        try:
            yield nursery
        except BaseException as exc:
            body_error = exc
        finally:
            nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error
