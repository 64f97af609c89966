"""The command line's pure helpers, in process: argument parsing and error translation."""

from __future__ import annotations

import random
import resource

import click
import pytest
import trio

from relay import LeasedJob, PermanentError
from relay.protocol.errors import ConnectionLost, JobNotFound, NotADatabase
from relay_cli.demo import DemoFailure, demo_counts, demo_handler, demo_jobs
from relay_cli.errors import _explain
from relay_cli.options import parse_duration, parse_rate
from relay_cli.server import SPARE_FILES, raise_open_files_limit
from relay_cli.submit import parse_backoff
from relay_cli.work import load_handler


def test_parse_backoff_forms():
    assert parse_backoff("fixed:300") == {"kind": "fixed", "delay_ms": 300}
    assert parse_backoff("exp:100:5000") == {
        "kind": "exponential", "base_ms": 100, "max_ms": 5000, "jitter": True,
    }  # fmt: skip
    assert parse_backoff("exp:100:5000:nojitter")["jitter"] is False
    assert parse_backoff("exponential:1:2:jitter")["jitter"] is True
    # Durations with their unit; a bare number stays milliseconds.
    assert parse_backoff("fixed:10s") == {"kind": "fixed", "delay_ms": 10_000}
    assert parse_backoff("exp:1s:5m:nojitter") == {
        "kind": "exponential", "base_ms": 1000, "max_ms": 300_000, "jitter": False,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("text", "ms"),
    [("1500ms", 1500), ("500", 500), ("30s", 30_000), ("1.5s", 1500), ("5m", 300_000),
     ("2h", 7_200_000), ("1d", 86_400_000), ("0", 0)],
)  # fmt: skip
def test_parse_duration_takes_a_number_and_a_unit(text, ms):
    assert parse_duration(text) == ms


@pytest.mark.parametrize("text", ["", "s", "1x", "1.5ms", "-1s", "1 s", "1.2.3s", "5mm"])
def test_parse_duration_refuses_other_forms(text):
    with pytest.raises(ValueError, match=repr(text).replace(".", r"\.")):
        parse_duration(text)


def test_parse_rate_takes_a_limit_per_period():
    assert parse_rate("100/s") == {"limit": 100, "period_ms": 1000}
    assert parse_rate("100/1s") == {"limit": 100, "period_ms": 1000}
    assert parse_rate("10/1m") == {"limit": 10, "period_ms": 60_000}
    assert parse_rate("5/500ms") == {"limit": 5, "period_ms": 500}
    for text in ("100", "/s", "x/s", "10/", "10/1x", "1.5/s"):
        with pytest.raises(ValueError, match="LIMIT/PERIOD"):
            parse_rate(text)


@pytest.mark.parametrize("text", ["fixed", "fixed:x", "fixed:1:2", "exp:1", "linear:5", ""])
def test_parse_backoff_refuses_other_forms(text):
    with pytest.raises(click.BadParameter, match="fixed:DELAY or exp:BASE:MAX"):
        parse_backoff(text)


def test_load_handler_imports_dotted_attributes():
    assert load_handler("json:dumps").__name__ == "dumps"
    assert load_handler("json:JSONDecoder.decode").__name__ == "decode"
    with pytest.raises(click.BadParameter, match="cannot import"):
        load_handler("no_such_module_xyz:run")
    with pytest.raises(click.BadParameter, match="is not callable"):
        load_handler("json:__name__")


def refused() -> OSError:
    """What trio.open_tcp_stream raises when nothing listens."""
    error = OSError("all attempts to connect to 127.0.0.1:9 failed")
    error.__cause__ = ExceptionGroup(
        "attempts", [ConnectionRefusedError(111, "Error connecting to ...: refused")]
    )
    return error


def test_explain_unwraps_exception_groups_into_one_line():
    grouped = BaseExceptionGroup("nursery", [BaseExceptionGroup("inner", [refused()])])
    assert _explain(grouped, "127.0.0.1:9").message == (
        "cannot connect to 127.0.0.1:9: Connection refused (is the server running there? or "
        "give --address)"
    )
    assert _explain(trio.TooSlowError(), "h:1").message == "cannot connect to h:1: timed out"
    assert _explain(ExceptionGroup("g", [JobNotFound("job_1")]), None).message == (
        "not_found: no job job_1"
    )
    assert _explain(ConnectionLost("stats: dropped"), None).message == (
        "connection_lost: stats: dropped"
    )
    database = _explain(NotADatabase("x.db", "not SQLite"), None)
    assert database.message == "refusing to open x.db: not SQLite"
    assert database.exit_code == 2  # a configuration error, as the server exits
    # Without an address an OSError is not about connecting; and bugs stay bugs.
    assert _explain(refused(), None) is None
    assert _explain(ExceptionGroup("g", [KeyError("x")]), "h:1") is None


@pytest.mark.parametrize("jobs", [1, 7, 60, 1000])
def test_demo_mix_adds_up_and_uses_every_priority(jobs):
    counts = demo_counts(jobs)
    assert sum(counts.values()) == jobs and min(counts.values()) >= 0
    mix = demo_jobs(jobs, random.Random(1))
    assert len(mix) == jobs
    if jobs >= 60:
        assert {job.get("priority") for job in mix} == {"low", "normal", "high", "critical"}
        assert {job["queue"] for job in mix} == {
            "email", "thumbnails", "reports", "payments", "webhooks",
        }  # fmt: skip


def leased(payload, attempt: int = 1) -> LeasedJob:
    return LeasedJob("job_1", "q", payload, "normal", attempt, 4, "token", 0)


async def test_demo_handler_does_what_the_payload_says(autojump_clock):
    started = trio.current_time()
    assert await demo_handler(leased({"sleep_ms": 1500})) == {"attempt": 1, "slept_ms": 1500}
    assert trio.current_time() - started == pytest.approx(1.5)
    assert await demo_handler(leased([1, 2])) == {"attempt": 1, "slept_ms": 0}
    assert await demo_handler(leased({"sleep_ms": "soon"})) == {"attempt": 1, "slept_ms": 0}
    with pytest.raises(DemoFailure, match="card declined"):
        await demo_handler(leased({"fail": True, "error": "card declined"}))
    with pytest.raises(PermanentError, match="gone"):
        await demo_handler(leased({"fail": True, "error": "gone", "retryable": False}))
    # fail_attempts: fails that many attempts, then succeeds.
    flaky = {"fail_attempts": 2, "error": "flaky"}
    for attempt in (1, 2):
        with pytest.raises(DemoFailure, match="flaky"):
            await demo_handler(leased(flaky, attempt))
    assert (await demo_handler(leased(flaky, 3)))["attempt"] == 3


def test_queue_depths_parse_queue_equals_number():
    from relay_cli.server import _parse_depths

    assert _parse_depths(("email=10", "a.b:c=0")) == {"email": 10, "a.b:c": 0}
    for bad in ("email", "=5", "bad name=3", "email=-1", "email=x"):
        with pytest.raises(click.BadParameter):
            _parse_depths((bad,))


class FakeLimits:
    """getrlimit / setrlimit of RLIMIT_NOFILE, without touching the process."""

    def __init__(self, soft: int, hard: int) -> None:
        self.soft, self.hard = soft, hard
        self.set_to: list[tuple[int, int]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(resource, "getrlimit", lambda _: (self.soft, self.hard))
        monkeypatch.setattr(resource, "setrlimit", lambda _, limits: self.set_to.append(limits))


def test_server_raises_a_low_open_files_limit_to_fit_max_connections(monkeypatch):
    limits = FakeLimits(soft=1024, hard=65536)
    limits.install(monkeypatch)
    raise_open_files_limit(1024)
    assert limits.set_to == [(1024 + SPARE_FILES, 65536)]


def test_server_leaves_a_high_enough_open_files_limit(monkeypatch):
    limits = FakeLimits(soft=1024 + SPARE_FILES, hard=65536)
    limits.install(monkeypatch)
    raise_open_files_limit(1024)
    assert limits.set_to == []


def test_server_warns_when_the_hard_limit_is_below_max_connections(monkeypatch, caplog):
    limits = FakeLimits(soft=256, hard=512)
    limits.install(monkeypatch)
    with caplog.at_level("WARNING", logger="relay.server"):
        raise_open_files_limit(1024)
    assert limits.set_to == [(512, 512)]
    assert [r.getMessage() for r in caplog.records] == ["server.open_files_limit"]


def test_server_warns_when_the_open_files_limit_cannot_be_raised(monkeypatch, caplog):
    limits = FakeLimits(soft=256, hard=resource.RLIM_INFINITY)
    limits.install(monkeypatch)

    def refuse(_: int, __: tuple[int, int]) -> None:
        raise ValueError("not allowed to raise maximum limit")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    with caplog.at_level("WARNING", logger="relay.server"):
        raise_open_files_limit(1024)
    assert [r.getMessage() for r in caplog.records] == ["server.open_files_limit"]
