"""The slot arithmetic of relay/protocol/cron.py: against a brute-force evaluation minute
by minute (Hypothesis: random expressions and zones), and the documented examples across
daylight-saving changes."""

from __future__ import annotations

import calendar
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.protocol import cron
from relay.protocol.errors import BadRequest

MINUTE_MS = 60_000
ZONES = [
    "UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "Asia/Kolkata",
    "America/Sao_Paulo", "Pacific/Chatham", "Europe/London", "Asia/Tehran",
]  # fmt: skip
FIELDS = [(0, 59), (0, 23), (1, 31), (1, 12), (0, 6)]


def ms(*args: int) -> int:
    return calendar.timegm(datetime(*args, tzinfo=UTC).timetuple()) * 1000


@st.composite
def field(draw: st.DrawFn, low: int, high: int) -> tuple[str, set[int] | None]:
    """One field as text, and the values it matches (None: "*")."""
    kind = draw(st.sampled_from(["star", "list", "range", "step"]))
    if kind == "star":
        return "*", None
    if kind == "list":
        values = draw(st.sets(st.integers(low, high), min_size=1, max_size=4))
        return ",".join(map(str, sorted(values))), values
    a = draw(st.integers(low, high - 1))
    b = draw(st.integers(a + 1, high))  # (cronsim reads "5-5/2" as "5/2": left out)
    if kind == "range":
        return f"{a}-{b}", set(range(a, b + 1))
    step = draw(st.integers(1, max(1, (high - low) // 2)))
    return f"{a}-{b}/{step}", set(range(a, b + 1, step))


def matches(fields: list[set[int] | None], local: datetime) -> bool:
    """Vixie cron's rule, written out: each field matches, and when both the day of the
    month and the day of the week are restricted, either of them may."""
    minute, hour, dom, month, dow = fields
    if minute is not None and local.minute not in minute:
        return False
    if hour is not None and local.hour not in hour:
        return False
    if month is not None and local.month not in month:
        return False
    weekday = (local.weekday() + 1) % 7  # Sunday is 0
    day_ok = dom is None or local.day in dom
    week_ok = dow is None or weekday in dow
    if dom is not None and dow is not None:
        return day_ok or week_ok
    return day_ok and week_ok


def brute_force(fields: list[set[int] | None], tz: str, start: int, end: int) -> list[int]:
    """Every minute in (start, end] whose local time matches, at its first occurrence."""
    zone = cron.zone(tz)
    out = []
    at = (start // MINUTE_MS + 1) * MINUTE_MS
    while at <= end:
        local = datetime.fromtimestamp(at // 1000, zone)
        if local.fold == 0 and matches(fields, local):
            out.append(at)
        at += MINUTE_MS
    return out


# Windows of two days around a daylight-saving change somewhere, or anywhere in 2026.
STARTS = [
    ms(2026, 3, 28), ms(2026, 10, 24), ms(2026, 3, 7), ms(2026, 10, 31), ms(2026, 4, 4),
    ms(2026, 9, 26), ms(2026, 2, 27), ms(2026, 1, 1), ms(2026, 6, 15),
]  # fmt: skip
WINDOW_MS = 2 * 24 * 3600 * 1000


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.tuples(*[field(low, high) for low, high in FIELDS]),
    tz=st.sampled_from(ZONES),
    start=st.sampled_from(STARTS),
    offset=st.integers(0, 24 * 3600 * 1000),
)
def test_slots_are_the_matching_minutes_at_their_first_occurrence(parts, tz, start, offset):
    expr = " ".join(text for text, _ in parts)
    fields = [values for _, values in parts]
    start += offset
    expected = brute_force(fields, tz, start, start + WINDOW_MS)
    got, at = [], start
    while True:
        at = cron.next_slot(expr, tz, at)
        if at is None or at > start + WINDOW_MS:
            break
        got.append(at)
    assert got == expected
    # Backwards: the latest slots up to the window's end are its last ones.
    assert cron.latest_slots(expr, tz, start + 1, start + WINDOW_MS, 5) == expected[-5:]


def test_a_skipped_local_time_does_not_run_and_a_repeated_one_runs_once():
    berlin = "Europe/Berlin"
    # 2026-03-29: 02:00 CET becomes 03:00 CEST. 02:30 does not exist that day.
    daily = cron.normalize_cron("30 2 * * *")
    at = cron.next_slot(daily, berlin, ms(2026, 3, 28, 12))
    assert at == ms(2026, 3, 30, 0, 30)  # 02:30 CEST on the 30th: the 29th has none
    # 2026-10-25: 03:00 CEST becomes 02:00 CET. 02:30 happens twice: once, the first.
    at = cron.next_slot(daily, berlin, ms(2026, 10, 24, 12))
    assert at == ms(2026, 10, 25, 0, 30)  # 02:30 CEST
    assert cron.next_slot(daily, berlin, at) == ms(2026, 10, 26, 1, 30)  # 02:30 CET, next day
    # Every half hour: 02:00 and 02:30 once (summer time), then nothing until 03:00 CET.
    half = cron.normalize_cron("*/30 * * * *")
    slots, at = [], ms(2026, 10, 24, 23, 15)
    for _ in range(5):
        at = cron.next_slot(half, berlin, at)
        slots.append(at)
    assert slots == [
        ms(2026, 10, 24, 23, 30), ms(2026, 10, 25, 0, 0), ms(2026, 10, 25, 0, 30),
        ms(2026, 10, 25, 2, 0), ms(2026, 10, 25, 2, 30),
    ]  # fmt: skip
    # From inside the repeated hour's second pass (01:15 UTC = 02:15 CET), the next is 03:00.
    assert cron.next_slot(half, berlin, ms(2026, 10, 25, 1, 15)) == ms(2026, 10, 25, 2, 0)
    assert cron.latest_slots(half, berlin, 0, ms(2026, 10, 25, 1, 15), 2) == [
        ms(2026, 10, 25, 0, 0), ms(2026, 10, 25, 0, 30),
    ]  # fmt: skip


def test_aliases_seconds_and_refusals_name_the_field():
    assert cron.normalize_cron("@daily") == "0 0 * * *"
    assert cron.normalize_cron("  0   3 * *  MON-FRI ") == "0 3 * * MON-FRI"
    assert cron.normalize_cron("*/5 * * * * *", allow_seconds=True) == "*/5 * * * * *"
    for bad in ["", "61 * * * *", "* * *", "0 0 30 2 *", "@reboot", "*/5 * * * * *"]:
        with pytest.raises(BadRequest) as info:
            cron.normalize_cron(bad)
        assert info.value.field == "cron", bad
    with pytest.raises(BadRequest) as info:
        cron.zone("Mars/Olympus_Mons")
    assert info.value.field == "timezone"
    # Seconds: every 5 s.
    expr = cron.normalize_cron("*/5 * * * * *", allow_seconds=True)
    assert cron.next_slot(expr, "UTC", ms(2026, 1, 1) + 1) == ms(2026, 1, 1) + 5000


def test_a_rare_slot_is_found_years_ahead():
    # 29 February: the next leap year's; the fifth Monday of February: 2044's.
    assert cron.next_slot("0 0 29 2 *", "UTC", ms(2026, 1, 1)) == ms(2028, 2, 29)
    assert cron.next_slot("0 0 * 2 MON#5", "UTC", ms(2026, 1, 1)) == ms(2044, 2, 29)
