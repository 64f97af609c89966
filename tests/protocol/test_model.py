"""Pure rules of the job model: ids, backoff, aging, truncation."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.protocol.model import (
    AGING_STEP_MS,
    Backoff,
    JobIdGenerator,
    Priority,
    effective_priority,
    format_job_id,
    job_id_abbreviation,
    job_id_keys,
    job_id_time,
    parse_job_id,
    truncate_utf8,
)
from tests.conftest import T0


@given(st.lists(st.integers(min_value=0, max_value=(1 << 42) - 1), min_size=1, max_size=200))
def test_job_ids_strictly_increase_as_strings_whatever_the_clock_does(times):
    generator = JobIdGenerator()
    ids = [format_job_id(generator.next_id(t)) for t in times]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert all(i.startswith("job_") for i in ids)


def test_job_ids_resume_after_the_highest_issued_id():
    first = JobIdGenerator()
    last = [first.next_id(T0) for _ in range(5)][-1]
    resumed = JobIdGenerator(last)
    # The clock stepped back an hour across the restart: still after the old ids.
    assert resumed.next_id(T0 - 3_600_000) > last


def test_job_id_carries_its_creation_time():
    key = JobIdGenerator().next_id(T0)
    assert job_id_time(format_job_id(key)) == T0
    assert parse_job_id(format_job_id(key)) == key


@pytest.mark.parametrize(
    "text", ["job_", "job_123", "JOB_0000000000000001", "job_000000000000000g", "x", ""]
)
def test_strings_that_are_not_job_ids_do_not_parse(text):
    assert parse_job_id(text) is None


def test_parse_refuses_ids_beyond_63_bits():
    assert parse_job_id("job_" + "f" * 16) is None


@given(st.integers(0, (1 << 63) - 1), st.integers(7, 16))
def test_an_abbreviated_id_names_the_range_of_the_keys_whose_ids_begin_so(key, digits):
    job_id = format_job_id(key)
    keys = job_id_keys(job_id[: 4 + digits])
    assert keys is not None and key in keys
    for edge in (keys.start, keys[-1]):  # the first and last ids that begin so
        assert format_job_id(edge).startswith(job_id[: 4 + digits])
    for outside in (keys.start - 1, keys.stop):  # the ids either side do not
        if 0 <= outside < 1 << 63:
            assert not format_job_id(outside).startswith(job_id[: 4 + digits])
    assert len(keys) == 16 ** (16 - digits) or keys.stop == 1 << 63


def test_abbreviations_past_63_bits_name_no_key_and_others_are_not_abbreviations():
    assert job_id_keys("job_7ffffff") == range(0x7FFFFFF << 36, 1 << 63)
    assert len(job_id_keys("job_8000000")) == len(job_id_keys("job_ffffffffffffffff")) == 0
    for text in ("job_123456", "job_" + "0" * 17, "job_ABCDEF0", "job_abcdef0\n", "abcdef01"):
        assert job_id_keys(text) is None


@given(st.integers(0, (1 << 63) - 1), st.lists(st.integers(0, (1 << 63) - 1), max_size=3))
def test_an_ids_abbreviation_is_its_shortest_start_no_other_id_has(key, others):
    others = [other for other in others if other != key]
    short = job_id_abbreviation(key, others)
    assert format_job_id(key).startswith(short) and len(short) >= len("job_") + 7
    assert not any(format_job_id(other).startswith(short) for other in others)
    if len(short) > len("job_") + 7:  # one digit fewer: the start of another id too
        assert any(format_job_id(other).startswith(short[:-1]) for other in others)


def test_abbreviations_of_ids_differing_in_their_last_digit_are_whole():
    assert job_id_abbreviation(0x10, [0x11]) == "job_0000000000000010"
    assert job_id_abbreviation(0x10, [0x0F]) == "job_000000000000001"
    assert job_id_abbreviation(T0 << 21, []) == format_job_id(T0 << 21)[:11]


def test_fixed_backoff_waits_the_same_every_time():
    policy = Backoff.fixed(2_500)
    assert [policy.delay_ms(n, random.Random(0)) for n in (1, 2, 7)] == [2_500] * 3


def test_exponential_backoff_doubles_up_to_its_maximum():
    policy = Backoff("exponential", base_ms=1_000, max_ms=10_000, jitter=False)
    delays = [policy.delay_ms(n, random.Random(0)) for n in range(1, 7)]
    assert delays == [1_000, 2_000, 4_000, 8_000, 10_000, 10_000]


def test_exponential_backoff_copes_with_huge_retry_numbers():
    policy = Backoff("exponential", base_ms=1, max_ms=300_000, jitter=False)
    assert policy.delay_ms(10_000, random.Random(0)) == 300_000


@given(retry=st.integers(1, 30), seed=st.integers(0, 2**32))
def test_jitter_stays_within_half_to_all_of_the_delay(retry, seed):
    plain = Backoff("exponential", base_ms=1_000, max_ms=300_000, jitter=False)
    jittered = Backoff("exponential", base_ms=1_000, max_ms=300_000, jitter=True)
    full = plain.delay_ms(retry, random.Random(seed))
    delay = jittered.delay_ms(retry, random.Random(seed))
    assert full // 2 <= delay <= full


def test_jitter_spreads_delays():
    policy = Backoff("exponential", base_ms=1_000, max_ms=300_000, jitter=True)
    rng = random.Random(7)
    delays = {policy.delay_ms(3, rng) for _ in range(200)}
    assert len(delays) > 50
    assert min(delays) < 2_500 and max(delays) > 3_500


@pytest.mark.parametrize(
    ("base", "waited", "expected"),
    [
        (Priority.LOW, 0, Priority.LOW),
        (Priority.LOW, AGING_STEP_MS - 1, Priority.LOW),
        (Priority.LOW, AGING_STEP_MS, Priority.NORMAL),
        (Priority.LOW, 2 * AGING_STEP_MS, Priority.HIGH),
        (Priority.LOW, 60 * AGING_STEP_MS, Priority.CRITICAL),
        (Priority.CRITICAL, 0, Priority.CRITICAL),
        (Priority.HIGH, AGING_STEP_MS * 5, Priority.CRITICAL),
    ],
)
def test_effective_priority_gains_one_class_per_full_minute_up_to_critical(base, waited, expected):
    assert effective_priority(base, T0, T0 + waited) == expected


def test_effective_priority_ignores_a_ready_time_in_the_future():
    assert effective_priority(Priority.NORMAL, T0 + 5_000, T0) == Priority.NORMAL


@pytest.mark.parametrize("name", ["low", "normal", "high", "critical"])
def test_priorities_round_trip_through_their_wire_names(name):
    assert Priority.from_wire(name).wire == name


@given(st.text(), st.integers(0, 64))
def test_truncation_keeps_valid_utf8_within_the_limit(text, limit):
    cut = truncate_utf8(text, limit)
    assert len(cut.encode()) <= limit
    assert text.startswith(cut)
    if len(text.encode()) <= limit:
        assert cut == text
