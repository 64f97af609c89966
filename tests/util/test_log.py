"""relay/util/log.py: the summary of events that come in floods; the level and format chosen
by ``configure``; the text format's lines; JSON lines of events."""

from __future__ import annotations

import io
import logging
import sys
import threading
import time
from collections.abc import Iterator

import orjson
import pytest

from relay.util.log import (
    JsonFormatter,
    LineWriter,
    LogConfigError,
    Summary,
    TextFormatter,
    configure,
    event,
    flush,
    text_value,
)
from relay.util.printable import printable


def test_a_flood_is_logged_once_per_interval_with_its_count():
    summary = Summary(interval=1.0)
    assert summary.count(10.0) == 1  # the first is logged at once
    assert [summary.count(10.0 + i / 10) for i in range(1, 10)] == [0] * 9
    assert summary.count(11.0) == 10  # nine held back, and this one
    assert summary.count(11.5) == 0
    assert summary.count(20.0) == 2


# -- configure: the level and the format ------------------------------------------------------


class FakeStream(io.StringIO):
    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


@pytest.fixture
def restore_relay_logger() -> Iterator[None]:
    logger = logging.getLogger("relay")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    try:
        yield
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.mark.usefixtures("restore_relay_logger")
@pytest.mark.parametrize(
    ("terminal", "variable", "chosen"),
    [(True, None, "text"), (False, None, "json"), (True, "json", "json"), (False, "text", "text"),
     (True, " JSON ", "json")],
)  # fmt: skip
def test_text_on_a_terminal_json_elsewhere_unless_relay_log_format_says(
    monkeypatch, terminal, variable, chosen
):
    if variable is None:
        monkeypatch.delenv("RELAY_LOG_FORMAT", raising=False)
    else:
        monkeypatch.setenv("RELAY_LOG_FORMAT", variable)
    stream = FakeStream(terminal)
    assert configure("info", stream) == chosen
    event(logging.getLogger("relay.test"), logging.INFO, "thing.happened", count=1)
    flush()
    line = stream.getvalue()
    if chosen == "json":
        assert orjson.loads(line)["event"] == "thing.happened"
    else:
        assert line.split()[1:] == ["info", "thing.happened", "count=1"]


@pytest.mark.usefixtures("restore_relay_logger")
@pytest.mark.parametrize(
    ("variable", "value"), [("RELAY_LOG", "loud"), ("RELAY_LOG_FORMAT", "xml")]
)
def test_an_unknown_level_or_format_changes_nothing(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    before = list(logging.getLogger("relay").handlers)
    with pytest.raises(LogConfigError, match=f"{variable} must be .*, not '{value}'") as raised:
        configure(stream=FakeStream(True))
    assert "\n" not in str(raised.value)
    assert logging.getLogger("relay").handlers == before


# -- the line writer: a stuck stderr never blocks the code that logs -------------------------


class StuckStream(io.StringIO):
    """A stream whose writes block until ``release`` is set, as a full pipe's do."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()  # a write has begun (and blocks)

    def write(self, text: str) -> int:
        self.entered.set()
        assert self.release.wait(10), "the test never released the stream"
        return super().write(text)


def writer_on(stream: io.StringIO, capacity: int) -> LineWriter:
    handler = LineWriter(stream, capacity=capacity)
    handler.setFormatter(JsonFormatter())
    return handler


def test_a_stuck_stream_blocks_the_writer_thread_not_the_code_that_logs():
    stream = StuckStream()
    handler = writer_on(stream, capacity=3)
    handler.emit(record("first"))
    assert stream.entered.wait(10)  # the thread is stuck writing "first"
    for i in range(6):  # returns at once: three wait, three are dropped
        handler.emit(record(f"waiting.{i}"))
    assert handler.dropped == 3
    stream.release.set()
    handler.flush()
    handler.emit(record("after"))
    handler.flush()
    events = [orjson.loads(line) for line in stream.getvalue().splitlines()]
    assert [e["event"] for e in events] == ["first", "waiting.0", "waiting.1", "waiting.2",
                                            "log.dropped", "after"]  # fmt: skip
    assert events[4]["count"] == 3
    assert handler.dropped == 0


def test_flush_gives_up_when_the_stream_takes_nothing():
    stream = StuckStream()
    handler = writer_on(stream, capacity=10)
    handler.emit(record("first"))
    handler.emit(record("second"))
    assert stream.entered.wait(10)
    handler.flush(patience=0.05)  # returns, though nothing was written
    assert stream.getvalue() == ""
    stream.release.set()
    handler.flush()
    assert len(stream.getvalue().splitlines()) == 2


# -- the text format ----------------------------------------------------------------------------


def record(name: str, level: int = logging.INFO, **fields: object) -> logging.LogRecord:
    made = logging.LogRecord("relay.test", level, __file__, 1, name, None, None)
    made.fields = fields
    made.created = time.mktime((2026, 1, 2, 12, 0, 1, 0, 0, -1))
    return made


def test_a_text_line_is_local_time_level_event_and_fields():
    fields = {"state": "retrying", "error": "smtp down: 421", "queues": ["email", "sms"],
              "attempt": 2, "ok": None, "limits": {"a": 1}}  # fmt: skip
    line = TextFormatter().format(record("job.failed", logging.WARNING, **fields))
    assert line == (
        '12:00:01 warn  job.failed state=retrying error="smtp down: 421" queues=email,sms '
        'attempt=2 ok=null limits={"a":1}'
    )


@pytest.mark.parametrize(
    ("value", "text"),
    [("plain", "plain"), ("", '""'), ("a b", '"a b"'), ('say "hi"', '"say \\"hi\\""'),
     ("k=v", '"k=v"'), ([], "[]"), (["a,b"], '["a,b"]'), (True, "true"), (1.5, "1.5")],
)  # fmt: skip
def test_a_field_value_reads_as_itself_and_stays_one_token(value, text):
    assert text_value(value) == text


def test_a_renderer_gives_an_event_its_own_text_and_a_traceback_follows():
    formatter = TextFormatter({"server.started": lambda f: f"up at {f['address']}\n  more"})
    assert formatter.format(record("server.started", address="h:1")) == (
        "12:00:01 info  up at h:1\n  more"
    )
    try:
        raise ValueError("boom")
    except ValueError:
        failed = record("internal", logging.ERROR)
        failed.exc_info = sys.exc_info()
    lines = formatter.format(failed).splitlines()
    assert lines[0] == "12:00:01 error internal"
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: boom"


def test_an_event_with_a_message_is_one_json_line_with_its_name_message_and_fields():
    logger = logging.getLogger("relay.test_log")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        traceback = "Traceback (most recent call last):\n  ...\nValueError"
        message = "job job_1 failed: 100% wrong"  # (a % is not a format)
        event(logger, logging.WARNING, "job.failed", message=message, job_id="job_1",
              traceback=traceback)  # fmt: skip
        event(logger, logging.WARNING, "plain", n=1)
    finally:
        logger.removeHandler(handler)
    with_message, plain = records
    # What a handler without relay's formatter prints: the message, one line.
    assert with_message.getMessage() == "job job_1 failed: 100% wrong"
    written = orjson.loads(JsonFormatter().format(with_message))
    assert written["event"] == "job.failed" and written["message"] == with_message.getMessage()
    assert written["job_id"] == "job_1" and written["traceback"].endswith("\nValueError")
    assert "\n" not in JsonFormatter().format(with_message)
    # Without one, the event's name is the message, and no "message" is written.
    assert plain.getMessage() == "plain"
    written = orjson.loads(JsonFormatter().format(plain))
    assert (written["event"], written["n"]) == ("plain", 1) and "message" not in written


def test_a_text_line_of_an_event_with_a_message_is_the_message_then_its_traceback():
    record = logging.LogRecord("relay.worker", logging.WARNING, __file__, 1, "%s",
                               ("job j failed: ValueError: no; dead",), None)  # fmt: skip
    record.event = "job.failed"
    record.fields = {"job_id": "j", "traceback": "Traceback (most recent call last):\n  x\n"}
    lines = TextFormatter().format(record).splitlines()
    assert lines[0].endswith("warn  job j failed: ValueError: no; dead"), lines
    assert lines[1:] == ["    Traceback (most recent call last):", "      x"]


def test_a_text_line_shows_a_workers_control_characters_as_escapes():
    """A worker's error and traceback reach a human log line (the server's dead-letter
    warning quotes the error): an escape sequence in them must not act on the terminal."""
    record = logging.LogRecord("relay.dispatch", logging.WARNING, __file__, 1, "%s",
                               ("job j dead: x\x1b[2J\x1b]0;title\x07",), None)  # fmt: skip
    record.event = "job.dead"
    record.fields = {"traceback": "Traceback\n  \x1b[31mred\n"}
    lines = TextFormatter().format(record).splitlines()
    assert lines[0].endswith("job j dead: x\\x1b[2J\\x1b]0;title\\x07"), lines
    assert lines[1:] == ["    Traceback", "      \\x1b[31mred"]


def test_printable_escapes_controls_and_bidirectional_overrides_and_keeps_the_rest():
    assert printable("a\x1b[2Jb\x07\x9b\ttab\nnext") == "a\\x1b[2Jb\\x07\\x9b\\x09tab\nnext"
    assert printable("abc\u202egnp.exe") == "abc\\u202egnp.exe"
    assert printable("naïve 日本 [/] \\x1b") == "naïve 日本 [/] \\x1b"  # already text
