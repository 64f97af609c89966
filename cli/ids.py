"""Job ids as the terminal shows them: each abbreviated as the server abbreviates it, unique
among all its jobs at the time it is shown (``short_ids``), so that what a table prints
can be typed back to ``inspect`` and ``dead retry``/``purge``. The views stay pure: they
take the mapping made here (cli/views.py, ``short``).
"""

from __future__ import annotations

from collections.abc import Sequence

from relay.client.client import Client
from relay.protocol.errors import BadRequest, UnknownOp


async def server_short_ids(client: Client, job_ids: Sequence[str]) -> dict[str, str] | None:
    """Whole id -> its shortest start that no other job's id on the server begins with now
    (``Client.short_ids``). None from a server without the op (``unknown_op``): the views
    then shorten the ids among their own rows (``views.short_ids``), as before it existed.

    A server whose ``max_batch`` is below the rows shown refuses the list (``bad_request``
    naming ``job_ids``): it is asked again in halves until its requests are small enough,
    a few more round trips on such a server only."""
    ids = list(dict.fromkeys(job_ids))
    shown: list[str] = []
    size = max(1, len(ids))
    try:
        while len(shown) < len(ids):
            try:
                shown += await client.short_ids(ids[len(shown) : len(shown) + size])
            except BadRequest as exc:
                if size == 1 or not exc.message.startswith("job_ids:"):
                    raise
                size = (size + 1) // 2
    except UnknownOp:
        return None
    return dict(zip(ids, shown, strict=True))
