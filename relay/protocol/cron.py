"""Cron schedules as pure rules of time: the expression, its time zone, and its slots.

A schedule's *slots* are the instants (UTC milliseconds) at which it runs. They are found
by evaluating the expression on the zone's local wall-clock time, with cronsim (chosen over
croniter: docs/design-decisions.md), and mapping each local time to an instant:

- a local time that does not exist (skipped when clocks go forward) has no slot: a
  schedule for ``30 2 * * *`` in Europe/Berlin does not run on the day 02:00 becomes 03:00;
- a local time that happens twice (when clocks go back) has one slot, at its first
  occurrence: ``30 2 * * *`` runs once at 02:30 summer time, not again an hour later, and
  ``*/30 * * * *`` runs at 02:00 and 02:30 summer time and then not until 03:00 winter time.

The calendar arithmetic is cronsim's on naive local times; the mapping is zoneinfo's
(``fold=0`` is the first occurrence, PEP 495). Both directions rest on one fact: that
mapping never goes back in time as the local time goes forward, so the slots after (or
before) an instant are a run of the local times after (or before) some local time.

Nothing here reads a clock: every function takes the instant it starts from.
"""

from __future__ import annotations

import calendar
import functools
import zoneinfo
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from relay.protocol.errors import BadRequest

# The common shorthands (Vixie cron's), as the five fields they stand for. ``@reboot`` has
# no slots and is refused.
ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
# Longest expression and zone name accepted: the longest sensible ones are far shorter.
MAX_CRON_CHARS = 256
MAX_ZONE_CHARS = 64
# Local times looked at before giving up on finding a slot: a slot is found within a few
# candidates, or within the candidates of one skipped or repeated hour (3,600 for a
# schedule of every second). An expression whose next match is past the year 9999 or
# more than 50 years away (cronsim's own bound) has no next slot.
MAX_CANDIDATES = 20_000


def _bad(field: str, problem: str) -> BadRequest:
    return BadRequest(f"{field}: {problem}", field=field)


def normalize_cron(expr: str, *, allow_seconds: bool = False) -> str:
    """``expr`` checked and normalized (an alias as its fields, spaces collapsed); raises
    ``BadRequest`` naming ``cron``. Five fields (minute hour day-of-month month
    day-of-week); six (a seconds field first) only with ``allow_seconds``."""
    if not isinstance(expr, str) or not expr.strip():
        raise _bad("cron", "must be a cron expression such as '0 3 * * *' or '@daily'")
    if len(expr) > MAX_CRON_CHARS:
        raise _bad("cron", f"longer than {MAX_CRON_CHARS} characters")
    text = " ".join(expr.split())
    if text.startswith("@"):
        fields = ALIASES.get(text.lower())
        if fields is None:
            raise _bad("cron", f"unknown shorthand {text} (one of {', '.join(ALIASES)})")
        text = fields
    count = len(text.split())
    if count == 6 and not allow_seconds:
        raise _bad(
            "cron", "a seconds field (six fields) needs a server run with "
            "--allow-second-schedules; at most once a minute is five fields",
        )  # fmt: skip
    if count not in (5, 6):
        raise _bad("cron", f"needs 5 fields (minute hour day month weekday), got {count}")
    try:
        CronSim(text, datetime(2000, 1, 1))
    except CronSimError as exc:
        raise _bad("cron", f"{str(exc).lower() or 'not a cron expression'} in {text!r}") from None
    return text


# Files of the time zone data that name no zone of their own: this host's zone, and a
# leftover rule file. Every server of one PostgreSQL database must read a schedule alike.
_HOST_ZONES = frozenset({"localtime", "posixrules"})


@functools.cache
def _iana_zones() -> frozenset[str]:
    # The zones the system's data (or the tzdata package) names: read once (~40 ms).
    return frozenset(zoneinfo.available_timezones()) - _HOST_ZONES


@functools.lru_cache(maxsize=1024)
def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; raises ``BadRequest`` naming ``timezone``. Names the
    time zone data holds but that are no IANA zone (``localtime``, ``posix/...``) are
    refused: they may mean another zone on another host."""
    if not isinstance(name, str) or not name or len(name) > MAX_ZONE_CHARS:
        raise _bad("timezone", "must be an IANA time zone name such as 'Europe/Berlin'")
    try:
        if name not in _iana_zones():
            raise ZoneInfoNotFoundError(name)
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise _bad("timezone", f"unknown time zone {name!r} (an IANA name: 'UTC', "
                   "'Europe/Berlin', 'America/New_York')") from None  # fmt: skip


def slot_ms(local: datetime, tz: ZoneInfo) -> int | None:
    """The instant of the naive local time ``local`` in ``tz``: its first occurrence if it
    happens twice, None if it does not exist (skipped by a change of offset)."""
    instant = local.replace(tzinfo=tz, fold=0).astimezone(UTC)
    if instant.astimezone(tz).replace(tzinfo=None) != local:
        return None  # in a gap: the round trip lands elsewhere
    return calendar.timegm(instant.timetuple()) * 1000 + instant.microsecond // 1000


def _local(at_ms: int, tz: ZoneInfo) -> datetime:
    """The aware local time of the whole second at or before ``at_ms``."""
    return datetime.fromtimestamp(at_ms // 1000, tz)


def _repeat_width(local: datetime) -> timedelta:
    """How far the local clock went back, if ``local`` is in the second pass of a repeated
    interval (``fold=1``); else zero."""
    if not local.fold:
        return timedelta(0)
    first = local.replace(fold=0).utcoffset() or timedelta(0)
    second = local.utcoffset() or timedelta(0)
    return max(first - second, timedelta(0))


def _candidates(expr: str, start: datetime, reverse: bool) -> Iterator[datetime]:
    try:
        yield from CronSim(expr, start, reverse=reverse)
    except (CronSimError, OverflowError, ValueError):  # past the calendar's end
        return


def next_slot(expr: str, tz_name: str, after_ms: int) -> int | None:
    """The first slot of ``expr`` (normalized) in ``tz_name`` strictly after ``after_ms``,
    or None if there is none."""
    tz = zone(tz_name)
    local = _local(after_ms, tz)
    # In a repeated interval's second pass, the local times just after this one had their
    # slot in the first pass: they come out at or before after_ms, and are passed over.
    start = local.replace(tzinfo=None)
    for n, candidate in enumerate(_candidates(expr, start, reverse=False)):
        if n >= MAX_CANDIDATES:
            return None
        at = slot_ms(candidate, tz)
        if at is not None and at > after_ms:
            return at
    return None


def latest_slots(expr: str, tz_name: str, since_ms: int, until_ms: int, limit: int) -> list[int]:
    """Up to ``limit`` slots of ``expr`` in ``tz_name`` within [since_ms, until_ms], the
    latest ones, oldest first."""
    if limit <= 0 or since_ms > until_ms:
        return []
    tz = zone(tz_name)
    local = _local(until_ms, tz)
    # From the end of a repeated interval if until_ms is in its second pass: the local
    # times up to there had their slots in the first pass, before until_ms.
    start = local.replace(tzinfo=None) + _repeat_width(local) + timedelta(seconds=1)
    found: list[int] = []
    for n, candidate in enumerate(_candidates(expr, start, reverse=True)):
        if n >= MAX_CANDIDATES + limit:
            break
        at = slot_ms(candidate, tz)
        if at is None or at > until_ms:
            continue
        if at < since_ms:
            break
        found.append(at)
        if len(found) == limit:
            break
    found.reverse()
    return found
