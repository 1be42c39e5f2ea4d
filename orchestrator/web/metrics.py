"""Prometheus metrics computed from the database on every scrape.

:func:`render` reads one :class:`~orchestrator.core.models.MetricsSnapshot` (``Reads.metrics_snapshot``:
bounded queries through the state index, the worker registry, the schedules and a primary-key
range of the newest ledger rows) and turns it into metric families with a custom collector on a
fresh :class:`~prometheus_client.CollectorRegistry`. Nothing is counted in memory between
scrapes, so every process (web app, CLI) exposes the same numbers for the same database, and a
restart loses nothing.

Everything computed over the recent window (the last ``window_seconds`` of the ledger, at most
``max_events`` rows) is a **gauge** or a **gauge histogram**: a windowed value goes down as old
events leave the window, which a counter must never do. ``orchestrator_metrics_window_seconds``
says how much time the window really covered (less than asked when ``max_events`` rows were
reached first).

When the database cannot be read, the scrape still answers: ``orchestrator_database_up`` is 0
and the other families are absent.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeHistogramMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core.models import MetricsSnapshot, WindowEvent
from ..core.states import DEADLINE_MISSED, TaskState

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator

log = logging.getLogger(__name__)

T = TaskState

#: seconds of ledger the windowed metrics look back
WINDOW_SECONDS = 900.0
#: most ledger rows one scrape reads for the window (the newest ones)
MAX_EVENTS = 10_000

#: upper bounds (seconds) of the dispatch lag buckets: READY -> claimed by a worker
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: upper bounds (seconds) of the attempt duration buckets: claimed -> outcome
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
#: upper bounds (seconds) of the run duration buckets: submitted -> final
RUN_BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)

#: the outcomes of an attempt (a RUNNING task's next state)
ATTEMPT_OUTCOMES = (T.SUCCEEDED, T.RETRYING, T.FAILED, T.DEAD_LETTER, T.CANCELLED)
#: final run states
RUN_OUTCOMES = ("SUCCEEDED", "FAILED", "CANCELLED")


def render(
    orc: Orchestrator,
    *,
    accept: str | None = None,
    window_seconds: float = WINDOW_SECONDS,
    max_events: int = MAX_EVENTS,
) -> tuple[bytes, str]:
    """The metrics page for one scrape: ``(body, content_type)``.

    ``accept`` is the scraper's ``Accept`` header: Prometheus asks for OpenMetrics, in which the
    distributions are typed ``gaugehistogram``; without it the classic text format (0.0.4) is
    returned, where prometheus_client writes a gauge histogram's buckets under ``# TYPE …
    histogram`` and its ``_gcount`` / ``_gsum`` as gauges (windowed all the same: never ``rate()``
    them). Every call reads the database (see :meth:`Reads.metrics_snapshot`).

    What a caller bound to a tenant sees: its tenant's tasks, runs, schedules and deadline
    misses only; the deployment's families (workers, their slots, the reconciler duty) are the
    operator's (an unbound orchestrator) and are absent for it. The scope is applied by the
    store's reads, not here.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(lambda: snapshot(orc, window_seconds, max_events)))
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def snapshot(
    orc: Orchestrator, window_seconds: float = WINDOW_SECONDS, max_events: int = MAX_EVENTS
) -> MetricsSnapshot:
    """The database's state for one scrape (see :meth:`Reads.metrics_snapshot`)."""
    return orc.metrics_snapshot(window_seconds=window_seconds, max_events=max_events)


class DatabaseCollector(Collector):
    """A prometheus_client collector that reads a fresh snapshot on every ``collect()``."""

    def __init__(self, read: Callable[[], MetricsSnapshot]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        started = time.monotonic()
        up = GaugeMetricFamily("orchestrator_database_up", "1 if this scrape could read the database, else 0")
        try:
            snap = self.read()
        except Exception:
            log.exception("metrics: reading the database failed")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families(snap)
        took = GaugeMetricFamily(
            "orchestrator_metrics_scrape_seconds", "Seconds this scrape spent reading and computing the metrics"
        )
        took.add_metric([], time.monotonic() - started)
        yield took


def families(snap: MetricsSnapshot) -> Iterator[Metric]:
    """Every metric family of one snapshot (pure: no database)."""
    yield from _tasks(snap)
    yield from _workers(snap)
    yield from _schedules(snap)
    yield from _breakers(snap)
    yield from _window(snap)


# ---------------------------------------------------------------------------- open work


def _tasks(snap: MetricsSnapshot) -> Iterator[Metric]:
    tasks = GaugeMetricFamily(
        "orchestrator_tasks",
        "Tasks not yet in a terminal state (PENDING, READY, QUEUED, RUNNING, RETRYING, WAITING, MAPPED,"
        " DEAD_LETTER), by state, queue and tenant",
        labels=["state", "queue", "tenant"],
    )
    backlog: dict[str, int] = {}
    oldest: dict[str, Any] = {}
    dead = 0
    for row in snap.open_tasks:
        tasks.add_metric([row.state, row.queue, row.tenant], row.count)
        if row.state == T.READY.value:
            backlog[row.queue] = backlog.get(row.queue, 0) + row.count
            if row.oldest_ready_at is not None and (row.queue not in oldest or row.oldest_ready_at < oldest[row.queue]):
                oldest[row.queue] = row.oldest_ready_at
        elif row.state == T.DEAD_LETTER.value:
            dead += row.count
    yield tasks
    # every queue with open work or a live consumer, so an empty backlog reads 0, not "absent"
    queues = sorted({r.queue for r in snap.open_tasks} | {q for w in snap.workers for q in w.queues})
    ready = GaugeMetricFamily(
        "orchestrator_ready_backlog", "Tasks READY and waiting for a worker slot, by queue", labels=["queue"]
    )
    age = GaugeMetricFamily(
        "orchestrator_ready_oldest_age_seconds",
        "Seconds the oldest READY task of the queue has waited (0 without a backlog)",
        labels=["queue"],
    )
    for q in queues:
        ready.add_metric([q], backlog.get(q, 0))
        first = oldest.get(q)
        age.add_metric([q], max((snap.now - first).total_seconds(), 0.0) if first is not None else 0.0)
    yield ready
    yield age
    dl = GaugeMetricFamily(
        "orchestrator_dead_letters_open", "Tasks parked in DEAD_LETTER, waiting for an operator (retry, skip or fail)"
    )
    dl.add_metric([], dead)
    yield dl
    stuck = GaugeMetricFamily(
        "orchestrator_stuck_tasks",
        "Tasks the reconciler's watchdog flagged (needs attention), by kind (unregistered: no live worker of"
        " its queue has its task registered; republished: its message re-published N times without a claim;"
        " idle: its run had no transition for ORCHESTRATOR_STUCK_RUN_SECONDS) and tenant",
        labels=["kind", "tenant"],
    )
    for (kind, tenant), n in sorted(snap.stuck.items()):
        stuck.add_metric([kind, tenant], n)
    yield stuck


def _workers(snap: MetricsSnapshot) -> Iterator[Metric]:
    live = GaugeMetricFamily(
        "orchestrator_workers_live", "Workers whose registry heartbeat is within ORCHESTRATOR_WORKER_TTL"
    )
    live.add_metric([], len(snap.workers))
    yield live
    slots = GaugeMetricFamily(
        "orchestrator_worker_slots", "Pool size (concurrency) of a live worker", labels=["worker"]
    )
    free = GaugeMetricFamily(
        "orchestrator_worker_free_slots", "Pool slots of a live worker with no task RUNNING on them", labels=["worker"]
    )
    seen = GaugeMetricFamily(
        "orchestrator_worker_heartbeat_age_seconds",
        "Seconds since a live worker last refreshed its registry row",
        labels=["worker"],
    )
    for w in snap.workers:
        slots.add_metric([w.name], w.concurrency)
        free.add_metric([w.name], w.free_slots)
        seen.add_metric([w.name], max((snap.now - w.seen_at).total_seconds(), 0.0))
    yield slots
    yield free
    yield seen
    duty = GaugeMetricFamily(
        "orchestrator_reconciler_on_duty",
        "1 for the reconciler holding the duty (one at a time, an advisory lock)",
        labels=["reconciler"],
    )
    for label in snap.reconciler_on_duty:
        duty.add_metric([label.removeprefix("orchestrator-reconciler:")], 1)
    yield duty


def _schedules(snap: MetricsSnapshot) -> Iterator[Metric]:
    lag = GaugeMetricFamily(
        "orchestrator_schedule_lag_seconds",
        "Seconds an active schedule's next instant is overdue on the database clock (0 when not due yet)",
        labels=["schedule", "tenant"],
    )
    for sch in snap.schedules:
        lag.add_metric([sch.name, sch.tenant], max((snap.now - sch.next_at).total_seconds(), 0.0))
    yield lag


# ---------------------------------------------------------------------------- circuit breakers

#: a breaker's states, each a series of ``orchestrator_breaker_state``
BREAKER_STATES = ("closed", "open", "half_open")


def _breakers(snap: MetricsSnapshot) -> Iterator[Metric]:
    state = GaugeMetricFamily(
        "orchestrator_breaker_state",
        "1 for the state each circuit breaker is in (closed, open, half_open), 0 for the others",
        labels=["breaker", "state", "mode"],
    )
    calls = GaugeMetricFamily(
        "orchestrator_breaker_calls", "Calls each circuit breaker counted in its window", labels=["breaker"]
    )
    failures = GaugeMetricFamily(
        "orchestrator_breaker_failures", "Failures each circuit breaker counted in its window", labels=["breaker"]
    )
    for name, mode, now_in, n_calls, n_failures in snap.breakers:
        for st in BREAKER_STATES:
            state.add_metric([name, st, mode], 1.0 if st == now_in else 0.0)
        calls.add_metric([name], n_calls)
        failures.add_metric([name], n_failures)
    changes = GaugeMetricFamily(
        "orchestrator_breaker_transitions",
        "State changes of each circuit breaker recorded in its ledger, by the state it went to",
        labels=["breaker", "to_state"],
    )
    for (name, to), n in sorted(snap.breaker_transitions.items()):
        changes.add_metric([name, to], n)
    yield state
    yield calls
    yield failures
    yield changes


# ---------------------------------------------------------------------------- the window


def _window(snap: MetricsSnapshot) -> Iterator[Metric]:
    covered = GaugeMetricFamily(
        "orchestrator_metrics_window_seconds",
        "Seconds of ledger the windowed metrics cover (less than the window when its row limit was reached)",
    )
    covered.add_metric([], max((snap.now - snap.window_start).total_seconds(), 0.0))
    yield covered
    rows = GaugeMetricFamily(
        "orchestrator_metrics_window_events", "Ledger rows the windowed metrics were computed from"
    )
    rows.add_metric([], snap.events_read)
    yield rows

    events = snap.events
    yield _histogram(
        "orchestrator_dispatch_lag_seconds",
        "Seconds from READY to the claim by a worker, for the claims in the window",
        "queue",
        _by_queue(dispatch_lags(events)),
        LAG_BUCKETS,
    )
    yield _histogram(
        "orchestrator_task_duration_seconds",
        "Seconds from the claim to the outcome of the attempts that ended in the window",
        "queue",
        _by_queue(attempt_durations(events)),
        DURATION_BUCKETS,
    )
    outcomes = GaugeMetricFamily(
        "orchestrator_attempts_finished",
        "Attempts that ended in the window, by outcome (SUCCEEDED, RETRYING, FAILED, DEAD_LETTER, CANCELLED)",
        labels=["outcome", "queue", "tenant"],
    )
    for (outcome, queue, tenant), n in sorted(_count(_attempt_outcomes(events)).items()):
        outcomes.add_metric([outcome, queue, tenant], n)
    yield outcomes
    runs: dict[str, list[float]] = {}
    finished: dict[tuple[str, str], int] = {}
    for e in events:
        if e.key is None and e.accepted and e.from_state == "RUNNING" and e.to_state in RUN_OUTCOMES:
            finished[(e.to_state, e.tenant)] = finished.get((e.to_state, e.tenant), 0) + 1
            if e.run_created_at is not None:
                runs.setdefault(e.tenant, []).append(max((e.at - e.run_created_at).total_seconds(), 0.0))
    yield _histogram(
        "orchestrator_run_duration_seconds",
        "Seconds from submit to the final state of the runs that ended in the window",
        "tenant",
        runs,
        RUN_BUCKETS,
    )
    ends = GaugeMetricFamily(
        "orchestrator_runs_finished", "Runs that reached a final state in the window", labels=["state", "tenant"]
    )
    for (state, tenant), n in sorted(finished.items()):
        ends.add_metric([state, tenant], n)
    yield ends
    actions = GaugeMetricFamily(
        "orchestrator_reconciler_actions",
        "Ledger rows the reconciler wrote in the window, by action (retry_released, republished, lease_expired,"
        " children_decided, run_closed, deadline_missed, task_cancelled, run_cancelled; rejected: a"
        " compare-and-set it lost)",
        labels=["action"],
    )
    for action, n in sorted(_count(reconciler_action(e) for e in events if e.actor == "reconciler").items()):
        actions.add_metric([action], n)
    yield actions
    misses = GaugeMetricFamily(
        "orchestrator_deadline_misses",
        "Deadline misses the reconciler recorded in the window, by scope (run or task) and tenant",
        labels=["scope", "tenant"],
    )
    for (scope, tenant), n in sorted(snap.deadline_misses.items()):
        misses.add_metric([scope, tenant], n)
    yield misses


def _by_queue(timed: Iterable[tuple[WindowEvent, float]]) -> dict[str, list[float]]:
    """Seconds grouped by the event's queue."""
    grouped: dict[str, list[float]] = {}
    for e, seconds in timed:
        grouped.setdefault(e.queue or "", []).append(seconds)
    return grouped


def dispatch_lags(events: Sequence[WindowEvent]) -> Iterator[tuple[WindowEvent, float]]:
    """(claim event, seconds since its attempt became READY) for every accepted claim in ``events``.

    The READY time is that attempt's READY event when it is in the window, else the task row's
    ``ready_at`` while the row still holds that attempt; a claim with neither is left out."""
    ready: dict[tuple[str, str | None, int], dt.datetime] = {
        (e.run_id, e.key, e.attempt): e.at
        for e in events
        if e.accepted and e.key and e.to_state == "READY" and e.kind is None
    }
    for e in events:
        if not (e.accepted and e.key and e.from_state == "QUEUED" and e.to_state == "RUNNING" and e.kind is None):
            continue
        since = ready.get((e.run_id, e.key, e.attempt))
        if since is None and e.task_attempt == e.attempt:
            since = e.task_ready_at
        if since is not None:
            yield e, max((e.at - since).total_seconds(), 0.0)


def attempt_durations(events: Sequence[WindowEvent]) -> Iterator[tuple[WindowEvent, float]]:
    """(outcome event, seconds since the attempt's claim) for every attempt that ended in ``events``.

    The claim is the attempt's QUEUED -> RUNNING event when it is in the window, else the task
    row's ``started_at`` while the row still holds that attempt."""
    claimed: dict[tuple[str, str | None, int], dt.datetime] = {
        (e.run_id, e.key, e.attempt): e.at
        for e in events
        if e.accepted and e.key and e.from_state == "QUEUED" and e.to_state == "RUNNING" and e.kind is None
    }
    for e in _ended_attempts(events):
        since = claimed.get((e.run_id, e.key, e.attempt))
        if since is None and e.task_attempt == e.attempt:
            since = e.task_started_at
        if since is not None:
            yield e, max((e.at - since).total_seconds(), 0.0)


def _ended_attempts(events: Iterable[WindowEvent]) -> Iterator[WindowEvent]:
    outcomes = {s.value for s in ATTEMPT_OUTCOMES}
    return (e for e in events if e.accepted and e.key and e.from_state == "RUNNING" and e.to_state in outcomes)


def _attempt_outcomes(events: Iterable[WindowEvent]) -> Iterator[tuple[str, str, str]]:
    return ((e.to_state, e.queue or "", e.tenant) for e in _ended_attempts(events))


def reconciler_action(e: WindowEvent) -> str:
    """What a reconciler's ledger row was (``Reconciler.run_pass``, ``store/deadlines.py``)."""
    if not e.accepted:
        return "rejected"
    if e.kind is not None:
        return "deadline_missed" if e.kind == DEADLINE_MISSED else e.kind
    if e.to_state == "CANCELLED":
        return "run_cancelled" if e.key is None else "task_cancelled"
    if e.key is None:
        return "run_closed"
    if e.from_state == "RETRYING" and e.to_state == "READY":
        return "retry_released"
    if e.from_state == "WAITING":
        return "wait_timed_out" if e.to_state in ("FAILED", "SKIPPED") else "wait_woken"
    if e.from_state == "QUEUED" and e.to_state == "QUEUED":
        return "republished"
    if e.from_state == "RUNNING":
        return "lease_expired"
    if e.from_state == "PENDING":
        return "children_decided"
    return "other"


def _histogram(
    name: str, documentation: str, label: str, samples: dict[str, list[float]], bounds: Sequence[float]
) -> GaugeHistogramMetricFamily:
    family = GaugeHistogramMetricFamily(name, documentation, labels=[label])
    for value, seconds in sorted(samples.items()):
        buckets = [(repr(float(b)), float(sum(1 for s in seconds if s <= b))) for b in bounds]
        buckets.append(("+Inf", float(len(seconds))))
        family.add_metric([value], buckets, gsum_value=sum(seconds))
    return family


def _count(items: Iterable[Any]) -> dict[Any, int]:
    counts: dict[Any, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts
