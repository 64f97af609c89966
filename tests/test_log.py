"""relay/log.py: JSON lines of events, and the summary of events that come in floods."""

from __future__ import annotations

import logging

import orjson

from relay.log import JsonFormatter, Summary, event


def test_a_flood_is_logged_once_per_interval_with_its_count():
    summary = Summary(interval=1.0)
    assert summary.count(10.0) == 1  # the first is logged at once
    assert [summary.count(10.0 + i / 10) for i in range(1, 10)] == [0] * 9
    assert summary.count(11.0) == 10  # nine held back, and this one
    assert summary.count(11.5) == 0
    assert summary.count(20.0) == 2


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
