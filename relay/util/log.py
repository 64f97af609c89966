"""Structured logs on stderr: one JSON object per line for programs, or one short line per
event for a person at a terminal.

Code logs through the standard ``logging`` module, with the event name as the message and
the fields in ``extra={"fields": {...}}``. ``configure`` installs a formatter on the
``relay`` logger, at the level named by ``RELAY_LOG`` (debug, info, warning), in the
format named by ``RELAY_LOG_FORMAT``: ``json`` (time, level, event, logger, fields), or
``human`` (``12:00:01 info  server.recovered_leases count=1``; ``text`` is its former name);
unset or ``auto``, human when stderr is a terminal and JSON otherwise (a file, a pipe, a
service manager's journal). Every command that logs calls ``configure`` first.
An event meant for people too (a worker's failed job) carries a one-line ``message``: the
text line then is that message (and the event's ``traceback`` field, if any, below it),
and it is what a program's own logging prints when it has not installed these formatters,
where the event name alone would say nothing. The JSON line keeps the event name and adds
the message.

Lines are written by a thread of their own (``LineWriter``), never by the code that logs:
stderr may be a pipe that nobody reads (a stuck log collector), and a blocked write there
must not stop the event loop, nor the signal handlers that run on its thread.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import textwrap
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from relay.util.printable import printable

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
# The formats by the names RELAY_LOG_FORMAT (and the server's --log-format) take: "text" is
# "human"'s former name; "auto" (or nothing): human on a terminal, JSON elsewhere.
FORMATS = {"json": "json", "human": "text", "text": "text", "auto": ""}
# The level as a text line shows it: at most five letters, so that events line up.
LEVEL_TAGS = {
    logging.DEBUG: "debug",
    logging.INFO: "info",
    logging.WARNING: "warn",
    logging.ERROR: "error",
    logging.CRITICAL: "crit",
}
# A text line's field value that needs no quotes: no space, quote, '=' or control character.
_BARE = re.compile(r"[^\s\"'=\\]+")

# An event's text line, from its fields, instead of ``name key=value...`` (it may span
# lines): for events a person reads first, such as the server's start-up summary.
Renderer = Callable[[Mapping[str, Any]], str]


class LogConfigError(ValueError):
    """``RELAY_LOG`` or ``RELAY_LOG_FORMAT`` names no level or format (the message is
    one line, for the person who set it)."""


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


class TextFormatter(logging.Formatter):
    """``HH:MM:SS level event key=value ...``, in local time, for a person at a terminal;
    a traceback follows on its own lines. ``renderers`` give some events their own text."""

    def __init__(self, renderers: Mapping[str, Renderer] | None = None) -> None:
        super().__init__()
        self.renderers = dict(renderers or {})

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        traceback = None
        if getattr(record, "event", None) is not None:  # an event with a message of its own
            text = record.getMessage()
            traceback = fields.get("traceback")
        elif (render := self.renderers.get(name := record.getMessage())) is not None:
            text = render(fields)
        else:
            text = " ".join([name, *(f"{key}={text_value(v)}" for key, v in fields.items())])
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        tag = LEVEL_TAGS.get(record.levelno, record.levelname.lower())
        line = f"{clock} {tag:<5} {printable(text)}"  # (a worker's error may be in it)
        if traceback:
            line += "\n" + textwrap.indent(printable(str(traceback)).rstrip("\n"), "    ")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def text_value(value: Any) -> str:
    """A field's value on a text line: a plain word as it is, other text quoted, a list of
    plain words joined by commas, anything else as compact JSON."""
    if isinstance(value, str):
        return value if _BARE.fullmatch(value) else orjson.dumps(value).decode()
    if isinstance(value, list | tuple) and all(
        isinstance(v, str) and _BARE.fullmatch(v) and "," not in v for v in value
    ):
        return ",".join(value) if value else "[]"
    return orjson.dumps(value, default=str).decode()


def configure(
    level: str | None = None,
    stream: Any = None,
    *,
    log_format: str | None = None,
    renderers: Mapping[str, Renderer] | None = None,
) -> str:
    """Send the ``relay`` logger's records to ``stream`` (stderr), and return the format
    chosen: "json" or "text" (the human one).

    ``level`` and ``log_format`` (a name of ``FORMATS``) default to ``RELAY_LOG`` (else
    info) and ``RELAY_LOG_FORMAT`` (else auto: text if ``stream`` is a terminal, JSON if not);
    ``renderers`` give events their own text lines. Raises LogConfigError, having changed
    nothing, for a level or format it does not know.
    """
    name = (level or os.environ.get("RELAY_LOG") or "info").strip().lower()
    if name not in LEVELS:
        raise LogConfigError(f"RELAY_LOG must be one of {', '.join(LEVELS)}, not {name!r}")
    given = (log_format or os.environ.get("RELAY_LOG_FORMAT") or "auto").strip().lower()
    if given not in FORMATS:
        raise LogConfigError(
            f"RELAY_LOG_FORMAT must be one of {', '.join(FORMATS)} (auto: human on a "
            f"terminal, else json), not {given!r}"
        )
    chosen = FORMATS[given]
    out = stream or sys.stderr
    if not chosen:
        chosen = "text" if is_terminal(out) else "json"
    logger = logging.getLogger("relay")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = LineWriter(out)
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter(renderers))
    logger.addHandler(handler)
    logger.setLevel(LEVELS[name])
    logger.propagate = False
    return chosen


# Lines waiting for the writer thread at most; past this, lines are dropped and counted.
MAX_WAITING_LINES = 10_000
# At exit, waiting lines are written unless the stream takes none for this long.
EXIT_PATIENCE_S = 1.0


class LineWriter(logging.Handler):
    """Formats each record where it is logged, and leaves the line for a thread that writes
    it to ``stream``: a write that blocks (a full pipe) blocks that thread alone. At most
    ``MAX_WAITING_LINES`` wait; past that a line is dropped, and the next one that finds
    room is preceded by a ``log.dropped`` line saying how many were. ``flush`` waits until
    every line is written or the stream took none for ``patience`` seconds; at exit,
    ``logging.shutdown`` calls it."""

    def __init__(self, stream: Any, capacity: int = MAX_WAITING_LINES) -> None:
        super().__init__()
        self.stream = stream
        self.capacity = capacity
        self.dropped = 0
        self._lines: deque[str] = deque()
        self._changed = threading.Condition()  # reentrant: a signal handler may log
        self._writing = False  # the thread holds a line it has not finished writing
        self._written = 0  # lines written so far, so that flush can see progress
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.StringIO and the like
            self._fd = None
        threading.Thread(target=self._run, name="relay-log", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:
            self.handleError(record)
            return
        with self._changed:
            if len(self._lines) >= self.capacity:
                self.dropped += 1
                return
            if self.dropped:
                self._lines.append(self._dropped_line(record))
                self.dropped = 0
            self._lines.append(line)
            self._changed.notify_all()

    def _dropped_line(self, record: logging.LogRecord) -> str:
        said = logging.LogRecord(record.name, logging.WARNING, __file__, 0, "log.dropped",
                                 None, None)  # fmt: skip
        said.fields = {"count": self.dropped, "reason": "stderr is not being read"}
        return self.format(said)

    def flush(self, patience: float = EXIT_PATIENCE_S) -> None:
        with self._changed:
            while self._lines or self._writing:
                before = self._written
                self._changed.wait(patience)
                if self._written == before:
                    return  # the stream takes nothing: give up rather than hang

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._lines:
                    self._changed.wait()
                line = self._lines.popleft()
                self._writing = True
            try:
                self._write(line + "\n")
            except (OSError, ValueError):
                pass  # stderr closed or broken: nowhere left to say it
            finally:
                with self._changed:
                    self._writing = False
                    self._written += 1
                    self._changed.notify_all()

    def _write(self, text: str) -> None:
        if self._fd is None:
            self.stream.write(text)
            self.stream.flush()
            return
        # Straight to the descriptor: a blocked write then holds no lock of sys.stderr's,
        # which the interpreter's exit and the signal handlers' own lines must take.
        data = text.encode("utf-8", "replace")
        while data:
            data = data[os.write(self._fd, data) :]


def flush() -> None:
    """Write the relay logger's waiting lines (for as long as stderr takes them), so that a
    line printed next, such as a command's error, comes after them."""
    for handler in logging.getLogger("relay").handlers:
        handler.flush()


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (a stream without ``isatty`` is not)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


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


class Summaries:
    """A ``Summary`` for each kind of one event (the reasons a connection is refused):
    each kind logged at most once per ``interval``, with its own count. The kinds are the
    caller's constants, so the table stays small."""

    def __init__(self, interval: float = SUMMARY_INTERVAL_S) -> None:
        self.interval = interval
        self._kinds: dict[str, Summary] = {}

    def count(self, kind: str, now: float) -> int:
        """Count one of ``kind`` at ``now``; return how many of it to log now (0: quiet)."""
        summary = self._kinds.get(kind)
        if summary is None:
            summary = self._kinds[kind] = Summary(self.interval)
        return summary.count(now)
