# ruff: noqa: E501 - the DST tables keep one case per line
"""Firing instants across the 2026 DST transitions, against lists worked out by hand from the
zones' rules (not from the code), and the catch-up and overlap decisions on fixed clocks.

The transitions (2026):
- America/New_York: EST (-5) -> EDT (-4) on Sun 8 March at 02:00 (02:00-02:59 do not exist);
  EDT -> EST on Sun 1 November at 02:00 (01:00-01:59 happen twice).
- Europe/London: GMT (0) -> BST (+1) on Sun 29 March at 01:00 (01:00-01:59 do not exist);
  BST -> GMT on Sun 25 October at 02:00 (01:00-01:59 happen twice).
- Australia/Lord_Howe: LHDT (+11) -> LHST (+10:30) on Sun 5 April at 02:00 (01:30-01:59 happen
  twice); LHST -> LHDT on Sun 4 October at 02:00 (02:00-02:29 do not exist).
"""

from __future__ import annotations

import datetime as dt

import pytest

from orchestrator.core.cron import (
    ScheduleError,
    Timing,
    count_instants,
    instants,
    last_instants,
    next_instant,
    previous_instant,
)
from orchestrator.core.firing import Decision, Policy, catch_up, overlap, plan


def z(text: str) -> dt.datetime:
    """'03-08 07:30' (2026) or '2026-03-08 07:30' in UTC."""
    if not text.startswith("20"):
        text = "2026-" + text
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC)


def fire(cron: str, tz: str, after: str, until: str, gap: str = "shift", fold: str = "first") -> list[str]:
    t = Timing(cron=cron, tz=tz, dst_gap=gap, dst_fold=fold)
    return [at.strftime("%m-%d %H:%M") for at in instants(t, z(after), z(until))]


NY, LONDON, LH = "America/New_York", "Europe/London", "Australia/Lord_Howe"

CASES = [
    # --- America/New_York, daily
    ("30 2 * * *", NY, "03-06 12:00", "03-10 00:00", "shift", "first", ["03-07 07:30", "03-08 07:30", "03-09 06:30"]),
    ("30 2 * * *", NY, "03-06 12:00", "03-10 00:00", "skip", "first", ["03-07 07:30", "03-09 06:30"]),
    ("30 2 * * *", NY, "10-30 12:00", "11-03 00:00", "shift", "first", ["10-31 06:30", "11-01 07:30", "11-02 07:30"]),
    ("30 1 * * *", NY, "10-30 12:00", "11-03 00:00", "shift", "first", ["10-31 05:30", "11-01 05:30", "11-02 06:30"]),
    ("30 1 * * *", NY, "10-30 12:00", "11-03 00:00", "shift", "last", ["10-31 05:30", "11-01 06:30", "11-02 06:30"]),
    ("30 1 * * *", NY, "10-30 12:00", "11-03 00:00", "shift", "both",
     ["10-31 05:30", "11-01 05:30", "11-01 06:30", "11-02 06:30"]),
    # --- America/New_York, hourly
    ("30 * * * *", NY, "03-08 04:00", "03-08 09:00", "shift", "first",
     ["03-08 04:30", "03-08 05:30", "03-08 06:30", "03-08 07:30", "03-08 08:30"]),
    ("30 * * * *", NY, "03-08 04:00", "03-08 09:00", "skip", "first",
     ["03-08 04:30", "03-08 05:30", "03-08 06:30", "03-08 07:30", "03-08 08:30"]),
    ("30 * * * *", NY, "11-01 04:00", "11-01 08:00", "shift", "first", ["11-01 04:30", "11-01 05:30", "11-01 07:30"]),
    ("30 * * * *", NY, "11-01 04:00", "11-01 08:00", "shift", "last", ["11-01 04:30", "11-01 06:30", "11-01 07:30"]),
    ("30 * * * *", NY, "11-01 04:00", "11-01 08:00", "shift", "both",
     ["11-01 04:30", "11-01 05:30", "11-01 06:30", "11-01 07:30"]),
    # --- America/New_York, every 15 minutes
    ("*/15 * * * *", NY, "03-08 06:45", "03-08 07:31", "shift", "first", ["03-08 07:00", "03-08 07:15", "03-08 07:30"]),
    ("*/15 * * * *", NY, "03-08 06:45", "03-08 07:31", "skip", "first", ["03-08 07:00", "03-08 07:15", "03-08 07:30"]),
    ("*/15 * * * *", NY, "11-01 04:50", "11-01 07:05", "shift", "first",
     ["11-01 05:00", "11-01 05:15", "11-01 05:30", "11-01 05:45", "11-01 07:00"]),
    ("*/15 * * * *", NY, "11-01 04:50", "11-01 07:05", "shift", "last",
     ["11-01 06:00", "11-01 06:15", "11-01 06:30", "11-01 06:45", "11-01 07:00"]),
    ("*/15 * * * *", NY, "11-01 04:50", "11-01 07:05", "shift", "both",
     ["11-01 05:00", "11-01 05:15", "11-01 05:30", "11-01 05:45", "11-01 06:00", "11-01 06:15", "11-01 06:30",
      "11-01 06:45", "11-01 07:00"]),
    # --- Europe/London, daily
    ("30 1 * * *", LONDON, "03-27 12:00", "03-31 00:00", "shift", "first", ["03-28 01:30", "03-29 01:30", "03-30 00:30"]),
    ("30 1 * * *", LONDON, "03-27 12:00", "03-31 00:00", "skip", "first", ["03-28 01:30", "03-30 00:30"]),
    ("30 1 * * *", LONDON, "10-23 12:00", "10-27 00:00", "shift", "first", ["10-24 00:30", "10-25 00:30", "10-26 01:30"]),
    ("30 1 * * *", LONDON, "10-23 12:00", "10-27 00:00", "shift", "last", ["10-24 00:30", "10-25 01:30", "10-26 01:30"]),
    ("30 1 * * *", LONDON, "10-23 12:00", "10-27 00:00", "shift", "both",
     ["10-24 00:30", "10-25 00:30", "10-25 01:30", "10-26 01:30"]),
    # --- Europe/London, hourly
    ("0 * * * *", LONDON, "03-28 23:30", "03-29 03:30", "shift", "first",
     ["03-29 00:00", "03-29 01:00", "03-29 02:00", "03-29 03:00"]),
    ("0 * * * *", LONDON, "03-28 23:30", "03-29 03:30", "skip", "first",
     ["03-29 00:00", "03-29 01:00", "03-29 02:00", "03-29 03:00"]),
    ("0 * * * *", LONDON, "10-24 23:30", "10-25 02:30", "shift", "first", ["10-25 00:00", "10-25 02:00"]),
    ("0 * * * *", LONDON, "10-24 23:30", "10-25 02:30", "shift", "last", ["10-25 01:00", "10-25 02:00"]),
    ("0 * * * *", LONDON, "10-24 23:30", "10-25 02:30", "shift", "both", ["10-25 00:00", "10-25 01:00", "10-25 02:00"]),
    # --- Europe/London, every 15 minutes
    ("*/15 * * * *", LONDON, "03-29 00:50", "03-29 01:20", "shift", "first", ["03-29 01:00", "03-29 01:15"]),
    ("*/15 * * * *", LONDON, "03-29 00:50", "03-29 01:20", "skip", "first", ["03-29 01:00", "03-29 01:15"]),
    ("*/15 * * * *", LONDON, "10-24 23:50", "10-25 01:20", "shift", "first",
     ["10-25 00:00", "10-25 00:15", "10-25 00:30", "10-25 00:45"]),
    ("*/15 * * * *", LONDON, "10-24 23:50", "10-25 01:20", "shift", "last", ["10-25 01:00", "10-25 01:15"]),
    ("*/15 * * * *", LONDON, "10-24 23:50", "10-25 01:20", "shift", "both",
     ["10-25 00:00", "10-25 00:15", "10-25 00:30", "10-25 00:45", "10-25 01:00", "10-25 01:15"]),
    # --- Australia/Lord_Howe (a 30-minute shift), daily
    ("15 2 * * *", LH, "10-02 12:00", "10-05 12:00", "shift", "first", ["10-02 15:45", "10-03 15:45", "10-04 15:15"]),
    ("15 2 * * *", LH, "10-02 12:00", "10-05 12:00", "skip", "first", ["10-02 15:45", "10-04 15:15"]),
    ("45 1 * * *", LH, "04-03 12:00", "04-06 12:00", "shift", "first", ["04-03 14:45", "04-04 14:45", "04-05 15:15"]),
    ("45 1 * * *", LH, "04-03 12:00", "04-06 12:00", "shift", "last", ["04-03 14:45", "04-04 15:15", "04-05 15:15"]),
    ("45 1 * * *", LH, "04-03 12:00", "04-06 12:00", "shift", "both",
     ["04-03 14:45", "04-04 14:45", "04-04 15:15", "04-05 15:15"]),
    # --- Australia/Lord_Howe, hourly
    ("15 * * * *", LH, "10-03 13:00", "10-03 17:00", "shift", "first",
     ["10-03 13:45", "10-03 14:45", "10-03 15:45", "10-03 16:15"]),
    ("15 * * * *", LH, "10-03 13:00", "10-03 17:00", "skip", "first", ["10-03 13:45", "10-03 14:45", "10-03 16:15"]),
    ("15 * * * *", LH, "04-04 13:00", "04-04 16:30", "shift", "both", ["04-04 13:15", "04-04 14:15", "04-04 15:45"]),
    ("45 * * * *", LH, "04-04 13:00", "04-04 17:00", "shift", "first", ["04-04 13:45", "04-04 14:45", "04-04 16:15"]),
    ("45 * * * *", LH, "04-04 13:00", "04-04 17:00", "shift", "last", ["04-04 13:45", "04-04 15:15", "04-04 16:15"]),
    ("45 * * * *", LH, "04-04 13:00", "04-04 17:00", "shift", "both",
     ["04-04 13:45", "04-04 14:45", "04-04 15:15", "04-04 16:15"]),
    # --- Australia/Lord_Howe, every 15 minutes
    ("*/15 * * * *", LH, "10-03 15:20", "10-03 16:05", "shift", "first", ["10-03 15:30", "10-03 15:45", "10-03 16:00"]),
    ("*/15 * * * *", LH, "10-03 15:20", "10-03 16:05", "skip", "first", ["10-03 15:30", "10-03 15:45", "10-03 16:00"]),
    ("*/15 * * * *", LH, "04-04 14:20", "04-04 15:35", "shift", "first", ["04-04 14:30", "04-04 14:45", "04-04 15:30"]),
    ("*/15 * * * *", LH, "04-04 14:20", "04-04 15:35", "shift", "last", ["04-04 15:00", "04-04 15:15", "04-04 15:30"]),
    ("*/15 * * * *", LH, "04-04 14:20", "04-04 15:35", "shift", "both",
     ["04-04 14:30", "04-04 14:45", "04-04 15:00", "04-04 15:15", "04-04 15:30"]),
]  # fmt: skip


@pytest.mark.parametrize(("cron", "tz", "after", "until", "gap", "fold", "expected"), CASES)
def test_firing_instants_across_the_2026_transitions(
    cron: str, tz: str, after: str, until: str, gap: str, fold: str, expected: list[str]
) -> None:
    assert fire(cron, tz, after, until, gap, fold) == expected


def test_the_issues_worked_examples() -> None:
    ny = Timing(cron="30 2 * * *", tz=NY)
    assert next_instant(ny, z("03-07 08:00")) == z("03-08 07:30")  # 02:30 shifted to 03:30 EDT
    fall = Timing(cron="30 1 * * *", tz=NY)
    assert next_instant(fall, z("10-31 12:00")) == z("11-01 05:30")  # 01:30 EDT, the first
    assert next_instant(Timing(cron="30 1 * * *", tz=NY, dst_fold="last"), z("10-31 12:00")) == z("11-01 06:30")
    assert previous_instant(ny, z("03-08 07:30")) == z("03-08 07:30")
    assert previous_instant(ny, z("03-08 07:29")) == z("03-07 07:30")


def test_intervals_run_in_absolute_time_whatever_the_zone() -> None:
    every = Timing(every=3600, tz=NY)  # the zone does not matter
    got = list(instants(every, z("03-08 05:00"), z("03-08 09:00")))
    assert got == [z("03-08 06:00"), z("03-08 07:00"), z("03-08 08:00"), z("03-08 09:00")]
    assert list(instants(Timing(every=90), z("03-08 00:00"), z("03-08 00:04"))) == [
        z("03-08 00:01:30"),
        z("03-08 00:03:00"),
    ]


def test_a_leap_day_cron_finds_its_next_29_february_even_across_2100() -> None:
    """Eight years ahead at most: 29 February 2096's next is 2104's (2100 is no leap year)."""
    leap = Timing(cron="0 0 29 2 *")
    assert next_instant(leap, z("2026-03-01 00:00")) == z("2028-02-29 00:00")
    in_2104 = dt.datetime(2104, 2, 29, tzinfo=dt.UTC)
    assert next_instant(leap, z("2096-02-29 00:00")) == in_2104
    assert previous_instant(leap, in_2104 - dt.timedelta(days=1)) == z("2096-02-29 00:00")
    assert next_instant(Timing(cron="30 2 29 2 *", tz=NY), z("2026-03-01 00:00")) == z("2028-02-29 07:30")


def test_impossible_crons_are_refused_and_long_searches_stay_cheap() -> None:
    import time

    began = time.monotonic()
    for cron in ("0 0 30 2 *", "0 0 31 4 *", "0 0 31 2,4,6,9,11 *"):
        with pytest.raises(ScheduleError, match="never fires"):
            Timing(cron=cron)
    leap = Timing(cron="0 0 29 2 *")
    assert list(instants(leap, z("2097-03-01 00:00"), dt.datetime(2104, 2, 28, tzinfo=dt.UTC))) == []  # 7 empty years
    minutely = Timing(cron="* * * * *", tz=LONDON)
    assert next(instants(minutely, z("2026-01-01 00:00"), z("2027-01-01 00:00"))) == z("2026-01-01 00:01")
    assert time.monotonic() - began < 2


def test_the_last_instants_and_a_bounded_count_of_a_long_range() -> None:
    hourly = Timing(cron="30 * * * *", tz=NY, dst_fold="both")
    after, until = z("2026-01-01 00:00"), z("2027-01-01 00:00")
    every = list(instants(hourly, after, until))
    assert len(every) == 365 * 24 - 1 + 1  # one hour lost in March, one repeated in November
    assert last_instants(hourly, after, until, 5) == every[-5:]
    assert last_instants(hourly, z("11-01 04:00"), z("11-01 08:00"), 3) == [
        z("11-01 05:30"),
        z("11-01 06:30"),  # 01:30 twice: EDT, then EST
        z("11-01 07:30"),
    ]
    assert count_instants(hourly, after, until, 100_000) == len(every)
    assert count_instants(hourly, after, until, 1000) == 1000  # "at least"
    ticks = Timing(every=1)
    assert count_instants(ticks, after, until, 10) == 365 * 86400  # an interval's count is exact
    assert last_instants(ticks, after, until, 2) == [until - dt.timedelta(seconds=1), until]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cron": "61 * * * *"}, "is not valid"),
        ({"cron": "* * * *"}, "must have 5 fields"),
        ({"cron": "0 * * * * *"}, "must have 5 fields"),
        ({"cron": "0 0 30 2 *"}, "never fires"),
        ({"cron": "* * * * *", "tz": "Mars/Base"}, "unknown time zone"),
        ({"cron": "* * * * *", "tz": "../etc/passwd"}, "unknown time zone"),
        ({"cron": "* * * * *", "dst_gap": "later"}, "dst_gap must be one of"),
        ({"cron": "* * * * *", "dst_fold": "second"}, "dst_fold must be one of"),
        ({"every": 0}, "every must be a number of seconds"),
        ({"every": True}, "every must be a number of seconds"),
        ({"cron": "* * * * *", "every": 5}, "one of them"),
        ({}, "one of them"),
    ],
)
def test_bad_timing_is_refused_with_a_named_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Timing(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- catch-up and overlap

NOW = z("03-10 12:00")
DUE = [z("03-10 08:00"), z("03-10 09:00"), z("03-10 10:00"), z("03-10 11:00"), z("03-10 12:00")]


def test_catchup_latest_fires_the_most_recent_and_records_the_rest() -> None:
    keep, skipped = catch_up(DUE, NOW, Policy(catchup="latest"))
    assert keep == [DUE[-1]]
    assert [d.at for d in skipped] == DUE[:-1] and all(d.action == "skip" and d.reason for d in skipped)


def test_catchup_all_is_bounded_by_max_catchup() -> None:
    keep, skipped = catch_up(DUE, NOW, Policy(catchup="all", max_catchup=3))
    assert keep == DUE[-3:] and [d.at for d in skipped] == DUE[:2]
    assert "max_catchup 3" in (skipped[0].reason or "")


def test_catchup_none_fires_only_an_instant_that_is_just_late() -> None:
    keep, skipped = catch_up(DUE, NOW + dt.timedelta(seconds=30), Policy(catchup="none", grace=60))
    assert keep == [DUE[-1]] and len(skipped) == 4
    keep, skipped = catch_up(DUE, NOW + dt.timedelta(minutes=5), Policy(catchup="none", grace=60))
    assert keep == [] and [d.at for d in skipped] == DUE


def test_overlap_policies() -> None:
    at = NOW
    assert overlap(at, 0, Policy(overlap="skip")).action == "fire"
    assert overlap(at, 1, Policy(overlap="skip")) == Decision(
        at, "skip", "scheduled", "overlap skip: 1 run(s) of the schedule still running"
    )
    assert overlap(at, 3, Policy(overlap="allow")).action == "fire"
    assert overlap(at, 2, Policy(overlap="allow", max_active_runs=2)).action == "skip"
    assert overlap(at, 1, Policy(overlap="buffer_one")).action == "buffer"
    cancel = overlap(at, 2, Policy(overlap="cancel_previous"))
    assert cancel.action == "fire" and cancel.cancel_running


def test_plan_with_catchup_all_and_overlap_skip_fires_once_then_skips() -> None:
    decisions, buffered = plan(DUE, NOW, 0, Policy(catchup="all", max_catchup=10, overlap="skip"))
    assert [(d.at, d.action) for d in decisions] == [(DUE[0], "fire")] + [(at, "skip") for at in DUE[1:]]
    assert decisions[0].kind == "catchup" and buffered is None


def test_plan_buffer_one_keeps_the_newest_and_fires_it_when_nothing_runs() -> None:
    decisions, buffered = plan(DUE[-2:], NOW, 1, Policy(catchup="all", overlap="buffer_one"))
    assert buffered == DUE[-1]
    assert [(d.at, d.action, d.reason) for d in decisions] == [
        (DUE[-2], "skip", "replaced by a later buffered instant")
    ]
    decisions, buffered = plan([], NOW, 0, Policy(overlap="buffer_one"), buffered=DUE[-1])
    assert [(d.at, d.action, d.kind) for d in decisions] == [(DUE[-1], "fire", "buffered")] and buffered is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"catchup": "some"}, "catchup must be one of"),
        ({"overlap": "queue"}, "overlap must be one of"),
        ({"max_catchup": 0}, "max_catchup must be an integer"),
        ({"max_active_runs": 0}, "max_active_runs must be an integer"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Policy(**kwargs)  # type: ignore[arg-type]
