"""What a schedule does with its due instants (pure code): catch-up and overlap.

Each pass of the scheduler (``orchestrator beat``) takes a schedule's instants that came due
since the last one it decided (judged by the database clock) and decides each one:

- **Catch-up** (after beat was down, or the schedule paused): ``latest`` (default) fires the most
  recent due instant and records the others as skipped; ``none`` fires only an instant that is at
  most ``grace`` seconds old (a beat that is merely late still fires), recording the rest as
  skipped; ``all`` fires every missed instant, oldest first, but at most ``max_catchup`` of them
  (the most recent ones), recording the older ones as skipped.
- **Overlap** (a previous run of the schedule is still RUNNING), Temporal's vocabulary:
  ``allow`` fires anyway; ``skip`` records the instant as skipped; ``buffer_one`` keeps the
  newest such instant and fires it when the running ones have ended (a buffered instant
  replaced by a newer one is recorded as skipped); ``cancel_previous`` cancels the running ones
  and fires. ``max_active_runs`` caps the schedule's RUNNING runs under every policy: an instant
  beyond it is skipped (buffered under ``buffer_one``).

Nothing is dropped silently: every due instant ends fired or with a recorded reason. The record
is bounded, however long beat was down: the newest :data:`RECORD_SKIPPED` skipped instants are
recorded one by one, the older ones by one summary firing (on the oldest) that counts them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from .cron import ScheduleError

CATCHUP = ("latest", "none", "all")
OVERLAP = ("allow", "skip", "buffer_one", "cancel_previous")
MAX_CATCHUP = 10_000
#: skipped instants recorded one by one per pass; older ones get one summary record
RECORD_SKIPPED = 100
#: the older missed instants of a cron schedule are counted up to this many ("at least")
COUNT_MOST = 10_000


@dataclass(frozen=True)
class Policy:
    catchup: str = "latest"
    max_catchup: int = 10
    overlap: str = "allow"
    max_active_runs: int | None = None
    #: seconds an instant may be late and still fire under catchup "none"
    grace: float = 60.0

    def __post_init__(self) -> None:
        if self.catchup not in CATCHUP:
            raise ScheduleError(f"catchup must be one of {', '.join(CATCHUP)}, not {self.catchup!r}")
        if self.overlap not in OVERLAP:
            raise ScheduleError(f"overlap must be one of {', '.join(OVERLAP)}, not {self.overlap!r}")
        m = self.max_catchup
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= MAX_CATCHUP:
            raise ScheduleError(f"max_catchup must be an integer from 1 to {MAX_CATCHUP}, not {m!r}")
        a = self.max_active_runs
        if a is not None and (isinstance(a, bool) or not isinstance(a, int) or not 1 <= a <= MAX_CATCHUP):
            raise ScheduleError(f"max_active_runs must be an integer from 1 to {MAX_CATCHUP}, not {a!r}")


@dataclass(frozen=True)
class Decision:
    """One instant's fate: ``fire`` (``kind`` scheduled, catchup or buffered), ``skip`` with a
    ``reason``, or ``buffer`` (buffer_one: wait for the running ones)."""

    at: dt.datetime
    action: str
    kind: str = "scheduled"
    reason: str | None = None
    #: cancel_previous: cancel the schedule's running runs first
    cancel_running: bool = False


def looked_at(policy: Policy) -> int:
    """How many of the newest due instants a pass decides one by one: those it may fire, and
    :data:`RECORD_SKIPPED` more to record as skipped."""
    return (policy.max_catchup if policy.catchup == "all" else 1) + RECORD_SKIPPED


def summary_reason(policy: Policy, older: int, at_least: bool, before: dt.datetime) -> str:
    """The reason of the one firing that stands for ``older`` missed instants (the oldest first)."""
    count = f"at least {older}" if at_least else str(older)
    return (
        f"missed while beat was down or the schedule paused (catchup {policy.catchup}): this instant and the"
        f" others before {before.astimezone(dt.UTC).isoformat()}, {count} in all, not recorded one by one"
    )


def catch_up(due: Sequence[dt.datetime], now: dt.datetime, policy: Policy) -> tuple[list[dt.datetime], list[Decision]]:
    """Split the due instants (oldest first) into those to fire and the skipped ones."""
    if not due:
        return [], []
    if policy.catchup == "all":
        keep = list(due[-policy.max_catchup :])
        dropped = due[: len(due) - len(keep)]
        why = f"missed while beat was down or the schedule paused; beyond max_catchup {policy.max_catchup}"
    elif policy.catchup == "latest":
        keep, dropped = [due[-1]], due[:-1]
        why = "missed while beat was down or the schedule paused (catchup latest: only the most recent runs)"
    else:
        late = (now - due[-1]).total_seconds()
        keep = [due[-1]] if late <= policy.grace else []
        dropped = due[: len(due) - len(keep)]
        why = "missed while beat was down or the schedule paused (catchup none)"
    return keep, [Decision(at, "skip", "catchup", why) for at in dropped]


def overlap(at: dt.datetime, running: int, policy: Policy, kind: str = "scheduled") -> Decision:
    """The decision for one instant to fire while ``running`` runs of the schedule are RUNNING."""
    full = policy.max_active_runs is not None and running >= policy.max_active_runs
    if policy.overlap == "cancel_previous" and running:
        return Decision(at, "fire", kind, cancel_running=True)
    if policy.overlap == "buffer_one" and running:
        return Decision(at, "buffer", kind, f"buffered: {running} run(s) of the schedule still running")
    if full:
        return Decision(at, "skip", kind, f"max_active_runs {policy.max_active_runs} reached ({running} running)")
    if policy.overlap == "skip" and running:
        return Decision(at, "skip", kind, f"overlap skip: {running} run(s) of the schedule still running")
    return Decision(at, "fire", kind)


def plan(
    due: Sequence[dt.datetime],
    now: dt.datetime,
    running: int,
    policy: Policy,
    buffered: dt.datetime | None = None,
) -> tuple[list[Decision], dt.datetime | None]:
    """Every due instant's decision, in order, and the instant left buffered (buffer_one).

    ``running`` is how many runs of the schedule are RUNNING now; each instant fired counts as
    one more for the next. A buffered instant fires first once nothing runs."""
    decisions: list[Decision] = []
    if buffered is not None:
        if running == 0 or policy.overlap != "buffer_one":
            decisions.append(Decision(buffered, "fire", "buffered"))
            running += 1
            buffered = None
    keep, skipped = catch_up(due, now, policy)
    decisions.extend(skipped)
    for at in keep:
        kind = "scheduled" if at == due[-1] else "catchup"
        d = overlap(at, running, policy, kind)
        if d.action == "buffer":
            if buffered is not None:
                decisions.append(Decision(buffered, "skip", "buffered", "replaced by a later buffered instant"))
            buffered = at
            continue
        decisions.append(d)
        if d.action == "fire":
            running = 1 if d.cancel_running else running + 1
    return decisions, buffered
