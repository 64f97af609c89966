"""Structured logs: one JSON object per line on stderr (time, level, event, fields).

Code logs through the standard ``logging`` module, with the event name as the message and
the fields in ``extra={"fields": {...}}``; ``configure`` installs the JSON formatter on the
``relay`` logger, at the level named by ``RELAY_LOG`` (debug, info, warning). An event
meant for people too (a worker's failed job) carries a one-line ``message``: what a
program's own logging prints when it has not installed this formatter, where the event
name alone would say nothing. The JSON line keeps the event name and adds the message.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

import orjson

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        name = getattr(record, "event", None)  # set by ``event`` when it has a message
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "event": name or record.getMessage(),
            "logger": record.name,
        }
        if name:
            entry["message"] = record.getMessage()
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure(level: str | None = None, stream: Any = None) -> None:
    """Send the ``relay`` logger's records to ``stream`` (stderr) as JSON lines."""
    name = (level or os.environ.get("RELAY_LOG") or "info").lower()
    if name not in LEVELS:
        raise ValueError(f"RELAY_LOG must be one of {', '.join(LEVELS)}, not {name!r}")
    logger = logging.getLogger("relay")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger.addHandler(handler)
    logger.setLevel(LEVELS[name])
    logger.propagate = False


def event(
    logger: logging.Logger, level: int, name: str, *, message: str | None = None, **fields: Any
) -> None:
    """Log ``name`` with ``fields`` (skipping the work when the level is off). With a
    ``message`` (one line), that is the record's message, and ``name`` its ``event``."""
    if logger.isEnabledFor(level):
        if message is None:
            logger.log(level, name, extra={"fields": fields})
        else:
            logger.log(level, "%s", message, extra={"event": name, "fields": fields})


# Events that may come in floods (refused connections) are logged at most this often.
SUMMARY_INTERVAL_S = 1.0


class Summary:
    """Counts one kind of event that may come in floods, and says when to log it: at most
    once per ``interval`` seconds, with how many there were since the last line (a client
    pool reconnecting in a loop would otherwise write a line per attempt)."""

    def __init__(self, interval: float = SUMMARY_INTERVAL_S) -> None:
        self.interval = interval
        self._count = 0
        self._logged_at = -math.inf

    def count(self, now: float) -> int:
        """Count one at ``now``; return how many to log now (0: stay quiet)."""
        self._count += 1
        if now - self._logged_at < self.interval:
            return 0
        n, self._count, self._logged_at = self._count, 0, now
        return n
