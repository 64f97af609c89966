"""The job model: states, priorities, retry policy and the pure rules over them. No I/O.

Everything here is a value (frozen attrs) or a pure function, so the store, the server and
the tests share one definition of "what a job is" and "when it runs next". The values made
once per job on the request path (``SubmitSpec``, ``SubmitResult``, ``Lease``) are named
tuples: as immutable, and made in a fraction of a frozen attrs class's time.
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import Iterable
from typing import NamedTuple

import attrs

# A job gains one priority class per full minute spent ready (see docs/design-decisions.md).
AGING_STEP_MS = 60_000

# A job id is "job_" + 16 hex digits of one 63-bit integer: milliseconds since the epoch
# shifted left 21 bits, plus a sequence number within the millisecond. The integer is the
# row's key in the store; the fixed-width lowercase hex makes the strings sort exactly as
# the integers do. 42 bits of milliseconds last until the year 2109; 21 bits of sequence
# allow 2 million ids within one millisecond before the generator borrows the next one.
ID_SEQ_BITS = 21
ID_MAX = (1 << 63) - 1
_ID_RE = re.compile(r"job_[0-9a-f]{16}")  # always fullmatch: "$" would allow a "\n"
ID_PREFIX = "job_"
ID_HEX_DIGITS = 16
# An abbreviated job id ("job_34472d0"; inspect with prefix: true, the command line) keeps
# at least this many hex digits: git's default abbreviation of a commit's hash. The first
# 7 digits of an id change every 2**15 ms (~33 s), so 7 to 11 tell most jobs apart.
ID_ABBREV_MIN = 7
_ID_ABBREV_RE = re.compile(rf"job_[0-9a-f]{{{ID_ABBREV_MIN},{ID_HEX_DIGITS}}}")  # fullmatch

QUEUE_NAME_MAX = 128
QUEUE_NAME_RE = re.compile(rf"[A-Za-z0-9._:-]{{1,{QUEUE_NAME_MAX}}}")  # always fullmatch


class JobState(enum.StrEnum):
    PENDING = "pending"  # delayed, not yet due
    READY = "ready"
    LEASED = "leased"
    RETRYING = "retrying"  # failed, waiting for its retry time
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELLED = "cancelled"  # (extension) cancelled by a client before it finished

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED)


class Priority(enum.IntEnum):
    LOW = 0
    NORMAL = 1
    HIGH = 2
    CRITICAL = 3

    @property
    def wire(self) -> str:
        return self.name.lower()

    @classmethod
    def from_wire(cls, name: str) -> Priority:
        return cls[name.upper()]


WIRE_PRIORITIES = tuple(p.wire for p in Priority)
PRIORITY_BY_WIRE = {p.wire: p for p in Priority}
# The same as plain ints, for what is bound to SQL: sqlite3 adapts an IntEnum parameter
# through its adapter protocol (two failed attribute look-ups, each an exception made).
PRIORITY_INT_BY_WIRE = {p.wire: int(p) for p in Priority}


def effective_priority(base: int, ready_at: int, now: int) -> int:
    """Base class plus one class per full minute spent ready, capped at critical."""
    waited = max(0, now - ready_at)
    return min(int(Priority.CRITICAL), base + waited // AGING_STEP_MS)


@attrs.frozen
class Backoff:
    """How long a failed job waits before its next attempt.

    ``fixed`` waits ``base_ms`` every time. ``exponential`` waits min(max_ms,
    base_ms * 2**(n-1)) before retry n; with ``jitter`` a uniformly random 50-100 % of that,
    so a burst of failures does not come back as a burst.
    """

    kind: str = "exponential"  # "fixed" | "exponential"
    base_ms: int = 1_000
    max_ms: int = 300_000
    jitter: bool = True

    @classmethod
    def fixed(cls, delay_ms: int) -> Backoff:
        return cls(kind="fixed", base_ms=delay_ms, max_ms=delay_ms, jitter=False)

    def delay_ms(self, retry: int, rng: random.Random) -> int:
        """The wait before retry number ``retry`` (1 for the first retry)."""
        if self.kind == "fixed":
            return self.base_ms
        doublings = retry - 1
        # Past 2**62 the product exceeds any max_ms a client may set; skip the big integer.
        full = self.max_ms if doublings >= 62 else min(self.max_ms, self.base_ms << doublings)
        if not self.jitter:
            return full
        half = (full + 1) // 2  # never below 50 %, also for an odd number of ms
        return half + rng.randint(0, full - half)


DEFAULT_BACKOFF = Backoff()
# A job's attempts when neither its submit nor its queue says: the first and 3 retries.
DEFAULT_MAX_ATTEMPTS = 4


@attrs.frozen
class Rate:
    """At most ``limit`` leases of a queue per window of ``period_ms``: a window opens with
    the first lease after the previous one closed (a queue's setting: relay/store/claims.py)."""

    limit: int
    period_ms: int


class SubmitSpec(NamedTuple):
    """One job to create. ``payload`` is its JSON text, already validated and size-checked.

    The due time is ``run_at`` if given, else now + ``delay_ms``; the store applies its own
    ``now`` so that the time is the server's, taken when the change is made.

    ``max_attempts``, ``backoff`` and ``timeout_ms`` are None where the submit left them
    out: the store resolves them when it makes the job, to its queue's default where one
    is set (``QueueSettings``), else to the protocol's (DEFAULT_MAX_ATTEMPTS,
    DEFAULT_BACKOFF, no timeout); the job keeps what it got.
    """

    queue: str
    payload: str
    priority: int = Priority.NORMAL
    delay_ms: int = 0
    run_at: int | None = None
    max_attempts: int | None = None
    backoff: Backoff | None = None
    idempotency_key: str | None = None
    # At most one job of the queue with this key while the holder is in ``unique_for``'s
    # scope (UNIQUE_FOR: "unfinished" or "queued"); checked when a job is submitted.
    unique_key: str | None = None
    unique_for: str = "unfinished"
    # The longest one attempt may run (None: the queue's default, else as long as its
    # lease is renewed).
    timeout_ms: int | None = None

    def due_at(self, now: int) -> int:
        return self.run_at if self.run_at is not None else now + self.delay_ms


# How long a unique key holds (``SubmitSpec.unique_key``): while its job is unfinished
# (pending, ready, leased or retrying), or only while it is queued (pending or ready,
# never leased: a release gives the attempt back and so counts as never leased).
UNIQUE_FOR = ("unfinished", "queued")


def unique_key_held(unique_for: str, state: str, attempt: int) -> bool:
    """Whether a job in ``state`` (at ``attempt``) still holds its unique key."""
    if unique_for == "queued":
        return state in ("pending", "ready") and attempt == 0
    return state in ("pending", "ready", "leased", "retrying")


# A job's execution timeout (``SubmitSpec.timeout_ms``) is enforced by the server too: the
# lease of an attempt, as granted and as renewed, never runs past the attempt's start +
# timeout_ms + this grace, which leaves a worker that stops its handler at the deadline
# the time to report the failure itself.
TIMEOUT_GRACE_MS = 2_000


def timeout_error(timeout_ms: int) -> str:
    """The error of an attempt that ran past its execution timeout."""
    return f"timed out after {timeout_ms} ms"


class SubmitResult(NamedTuple):
    job_id: str
    state: JobState
    duplicate: bool


class Lease(NamedTuple):
    """A claimed job as a worker sees it. ``payload`` is JSON text."""

    job_id: str
    queue: str
    payload: str
    priority: int
    attempt: int
    max_attempts: int
    token: str
    lease_expires_at: int
    timeout_ms: int | None = None  # the job's execution timeout, if it has one
    # The slot of the schedule that created the job (UTC ms), if one did.
    scheduled_for: int | None = None


@attrs.frozen
class FailOutcome:
    state: JobState  # RETRYING or DEAD
    retry_at: int | None


@attrs.frozen
class ErrorEntry:
    """One failed attempt of a job: its error text, and the traceback the worker sent with
    it (None where none was given: a lease that expired, a client that sent none)."""

    attempt: int
    error: str
    at: int
    traceback: str | None = None


class AttemptOutcome(enum.StrEnum):
    """How one attempt of a job (one lease of it) ended, or that it runs now."""

    RUNNING = "running"  # leased now
    SUCCEEDED = "succeeded"  # acked
    FAILED = "failed"  # its worker sent fail
    EXPIRED = "expired"  # its lease expired, not renewed
    TIMED_OUT = "timed_out"  # it reached its execution timeout
    RELEASED = "released"  # its worker gave it back (the attempt number is reused)
    CANCELLED = "cancelled"  # the job was cancelled while leased
    INTERRUPTED = "interrupted"  # the server restarted while it was leased (SQLite)

    @property
    def erred(self) -> bool:
        """Whether this outcome is an error of the job's (an entry of ``errors``)."""
        return self in _ERRED


_ERRED = frozenset(
    (AttemptOutcome.FAILED, AttemptOutcome.EXPIRED, AttemptOutcome.TIMED_OUT,
     AttemptOutcome.INTERRUPTED)
)  # fmt: skip


@attrs.frozen
class AttemptEntry:
    """One attempt of a job: when it started and ended, on which worker, how it ended,
    and its error and traceback (for the outcomes that are errors). ``started_at`` and
    ``worker_id`` are None for an attempt recorded by a relay-trio that did not keep
    them; ``ended_at`` is None while it runs."""

    attempt: int
    outcome: AttemptOutcome
    started_at: int | None = None
    ended_at: int | None = None
    worker_id: str | None = None
    error: str | None = None
    traceback: str | None = None


@attrs.frozen
class JobInfo:
    """Everything ``inspect`` shows of a job. ``payload`` and ``result`` are JSON text.

    ``lease_expires_at`` is set only while the job is leased; ``worker_id`` names the last
    worker that leased it.
    """

    job_id: str
    queue: str
    state: JobState
    priority: int
    payload: str
    attempt: int
    max_attempts: int
    created_at: int
    ready_at: int | None = None
    run_at: int | None = None
    lease_expires_at: int | None = None
    worker_id: str | None = None
    last_error: str | None = None
    errors: tuple[ErrorEntry, ...] = ()
    result: str | None = None
    idempotency_key: str | None = None
    finished_at: int | None = None
    timeout_ms: int | None = None
    scheduled_for: int | None = None  # the slot of the schedule that created it (UTC ms)
    # Its attempts, oldest first: the last ATTEMPTS_KEPT that ended, then the one running
    # or the one that succeeded; and how many older ended ones were dropped by that bound.
    attempts: tuple[AttemptEntry, ...] = ()
    attempts_dropped: int = 0


class JobIdGenerator:
    """Job ids that sort by creation time, strictly, also within one millisecond.

    Seeded at open with the highest id ever issued, so the order also holds across restarts
    and when the wall clock steps back: a new id never sorts before an old one.
    """

    def __init__(self, last_id: int = 0) -> None:
        self.last_id = last_id

    def next_id(self, now_ms: int) -> int:
        candidate = now_ms << ID_SEQ_BITS
        # Same millisecond (or a clock that stepped back): the next sequence number; past
        # the last sequence number this carries into the next millisecond.
        self.last_id = candidate if candidate > self.last_id else self.last_id + 1
        return self.last_id


def format_job_id(key: int) -> str:
    return f"job_{key:016x}"


def parse_job_id(job_id: str) -> int | None:
    """The integer key of a job id, or None if the string is not a relay-trio job id."""
    if not _ID_RE.fullmatch(job_id):
        return None
    key = int(job_id[4:], 16)
    return key if key <= ID_MAX else None


def job_id_keys(abbreviated: str) -> range | None:
    """The keys of every job id that begins with ``abbreviated`` ("job_" and 7 to 16 of an
    id's hex digits), or None if it is not such an abbreviation. The digits given are the
    key's top ones, so the keys are one range, [p << 4(16 - k), (p + 1) << 4(16 - k)) for
    k digits of value p: one range read of the store's key. Empty where no id can begin
    so (a first digit of 8 or more: a key has 63 bits)."""
    if not _ID_ABBREV_RE.fullmatch(abbreviated):
        return None
    digits = abbreviated[len(ID_PREFIX) :]
    shift = 4 * (ID_HEX_DIGITS - len(digits))
    low = int(digits, 16) << shift
    return range(low, min(low + (1 << shift), ID_MAX + 1))


def job_id_abbreviation(key: int, others: Iterable[int]) -> str:
    """The shortest start of ``key``'s job id, "job_" and ID_ABBREV_MIN hex digits at
    least, that no id of ``others`` (other keys) begins with: one digit more than the most
    it shares with any of them, as git abbreviates a hash. Ids sort as their keys do, so
    an id shares the most digits with its nearest neighbours: given the nearest key below
    and the nearest above, the abbreviation is unique among every key there is."""
    digits = ID_ABBREV_MIN
    for other in others:
        # The digits two ids share: those above the highest bit in which their keys differ.
        shared = (4 * ID_HEX_DIGITS - (key ^ other).bit_length()) // 4
        digits = max(digits, shared + 1)
    return format_job_id(key)[: len(ID_PREFIX) + digits]


def job_id_time(job_id: str) -> int | None:
    """Milliseconds since the epoch at which the job was created, from its id."""
    key = parse_job_id(job_id)
    return None if key is None else key >> ID_SEQ_BITS


def truncate_utf8(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` of UTF-8, never inside a character."""
    encoded = text.encode("utf-8")
    if len(encoded) <= max_bytes:
        return text
    return encoded[:max_bytes].decode("utf-8", errors="ignore")


def truncate_utf8_end(text: str, max_bytes: int) -> str:
    """The end of ``text``, at most ``max_bytes`` of UTF-8, never inside a character: what
    a traceback keeps, since its last lines name the failing frame and the exception."""
    if len(text) * 4 <= max_bytes:  # (a character is at most 4 bytes)
        return text
    encoded = text.encode("utf-8")
    if len(encoded) <= max_bytes:
        return text
    return encoded[len(encoded) - max_bytes :].decode("utf-8", errors="ignore")
