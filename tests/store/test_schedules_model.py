"""A Hypothesis state machine over the SQLite store's schedules: random puts, replaces,
pauses, resumes, deletes and passes of the scheduler at moving times (back-to-back, or
after long stops), checked against the invariants that make a slot exactly-once:

- no (schedule, slot) has two jobs, across replaces and pauses too;
- every job a schedule made carries a slot that is one of its expression's slots, no
  later than the time of the pass that made it;
- a schedule's next slot is after its last slot, and after the last pass's time;
- with catch_up "all" (and a bound above the slots missed), no slot is missing between a
  schedule's first and last slot while it was neither paused nor replaced.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from relay.protocol import cron
from relay.store.base import ScheduleSpec
from relay.store.sqlite import SqliteStore
from tests.store.test_schedules import T

NAMES = ("a", "b", "c")
EXPRS = ("* * * * *", "*/7 * * * *", "30 2 * * *", "0 */3 * * 1-5", "15,45 * 1 * *")
ZONES = ("UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe")


class Schedules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = SqliteStore.open(":memory:")
        self.now = T
        # name -> (spec, whether it may have gaps: paused, replaced, or catch-up not "all")
        self.defined: dict[str, ScheduleSpec] = {}
        self.gappy: set[str] = set()
        self.made: dict[str, list[tuple[int, int]]] = {}  # name -> [(slot, pass time)]

    @rule(
        name=st.sampled_from(NAMES), expr=st.sampled_from(EXPRS), tz=st.sampled_from(ZONES),
        catch_up=st.sampled_from(["latest", "none", "all"]),
    )  # fmt: skip
    def put(self, name: str, expr: str, tz: str, catch_up: str) -> None:
        spec = ScheduleSpec(name, expr, tz, "q", "1", catch_up=catch_up, catch_up_max=1000)
        if name in self.defined or catch_up != "all":
            self.gappy.add(name)
        self.defined[name] = spec
        self.store.schedule_put(spec, self.now)

    @rule(name=st.sampled_from(NAMES))
    def put_again(self, name: str) -> None:
        """The same definition put again (a deploy that re-applies its schedules): nothing
        of its slots changes, whatever the time."""
        spec = self.defined.get(name)
        if spec is not None:
            self.store.schedule_put(spec, self.now)

    @rule(name=st.sampled_from(NAMES), paused=st.booleans())
    def pause(self, name: str, paused: bool) -> None:
        if name in self.defined:
            self.gappy.add(name)
            self.store.schedule_pause(name, paused, self.now)

    @rule(name=st.sampled_from(NAMES))
    def delete(self, name: str) -> None:
        if self.defined.pop(name, None) is not None:
            self.store.schedule_delete(name)
            self.gappy.add(name)  # (a later put starts again: gaps between)

    # Stops of up to three hours: "* * * * *" then misses 180 slots, under catch_up_max;
    # the times land on a minute's start often (where a slot is exactly now).
    @rule(
        minutes=st.sampled_from([0, 1, 2, 7, 60, 180]), ms=st.sampled_from([0, 1, 30_000, 59_999])
    )
    def run(self, minutes: int, ms: int) -> None:
        self.now += minutes * 60_000 + ms
        while True:  # as the scheduler's pass does, until none is due
            self.store.begin()
            runs = self.store.schedules_run_due(self.now, 100)
            self.store.commit()
            for r in runs:
                assert r.job_id is not None
                self.made.setdefault(r.name, []).append((r.slot, self.now))
            due = self.store.next_schedule_at()
            if due is None or due > self.now:
                break

    @invariant()
    def each_slot_once_and_a_real_slot(self) -> None:
        for name, made in self.made.items():
            slots = [slot for slot, _ in made]
            assert len(slots) == len(set(slots)), f"{name}: a slot twice"
            for slot, at in made:
                assert slot <= at
        for info in self.store.schedule_list(None, 10):
            if info.last_slot is not None and info.next_at is not None:
                assert info.next_at > info.last_slot
            if info.next_at is not None and not info.paused:
                assert info.next_at >= self.now  # (a put at a slot's time: that slot)

    def teardown(self) -> None:
        try:
            self.none_missing_with_catch_up_all()
        finally:
            self.store.close()

    def none_missing_with_catch_up_all(self) -> None:
        for name, spec in self.defined.items():
            made = sorted(slot for slot, _ in self.made.get(name, []))
            if name in self.gappy or len(made) < 2:
                continue
            expected, at = [made[0]], made[0]
            while (at := cron.next_slot(spec.cron, spec.timezone, at)) is not None and at <= made[
                -1
            ]:
                expected.append(at)
            assert made == expected, f"{name}: slots missing"


Schedules.TestCase.settings = settings(max_examples=250, stateful_step_count=20, deadline=None)
test_schedules_model = Schedules.TestCase
