"""Domain values that cross the store boundary: frozen dataclasses, built from rows in
``store/rows.py`` only."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from .protocol import FencingToken
from .states import RunState, TaskState


@dataclass(frozen=True)
class Actor:
    """Who makes a state change: the role (``submit``, ``dispatcher``, ``worker``,
    ``reconciler``, ``operator``, ``event``) checked against the transition tables, and for operator
    actions the person it acts for (``by``), recorded in the ledger."""

    role: str
    by: str | None = None


SUBMIT, DISPATCHER, WORKER, RECONCILER = Actor("submit"), Actor("dispatcher"), Actor("worker"), Actor("reconciler")
#: an event or a signal that woke waiting tasks (``orchestrator.emit``, ``run.signal``)
EVENT = Actor("event")


def operator(by: str | None) -> Actor:
    return Actor("operator", by)


@dataclass(frozen=True)
class Dispatch:
    """One Celery message to publish for (task, attempt)."""

    run_id: str
    key: str
    attempt: int
    task_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    queue: str
    soft_time_limit: float | None
    time_limit: float | None
    #: the priority class's rank (0 high, 1 default, 2 low): the message priority on RabbitMQ
    priority_rank: int = 1
    #: the message's arguments are all its body gets (no upstream results, map item, sensor or
    #: resumed state): its worker may start the body before the claim (``ORCHESTRATOR_CLAIM_DELAY``)
    direct: bool = False

    @property
    def token(self) -> FencingToken:
        return FencingToken(self.run_id, self.key, self.attempt)

    @property
    def task_id(self) -> str:
        return self.token.task_id


@dataclass(frozen=True)
class Outcome:
    """What a state change did: whether its compare-and-set was accepted, the state it
    moved the task to, and the messages it admitted (to publish after the commit)."""

    accepted: bool
    state: TaskState | None
    dispatches: list[Dispatch] = field(default_factory=list)
    #: when not accepted: what the row held instead (for the caller's error message)
    conflict: str | None = None


@dataclass(frozen=True)
class Claim:
    """What a worker learns when its claim (QUEUED -> RUNNING) is accepted."""

    run_id: str
    key: str
    attempt: int
    args: list[Any]
    kwargs: dict[str, Any]
    #: the task declares ``upstream`` (decided once, at submit): pass it ``upstream_results``
    wants_upstream: bool = False
    upstream_results: dict[str, Any] = field(default_factory=dict)
    #: a sensor's polling (``{"kind": "sensor", "every", "timeout", ...}``), or None
    sensor: dict[str, Any] | None = None
    #: a body called again after it deferred: ``{"event": payload or None, "state": what it
    #: saved, "timed_out": false}``; None on a first call
    resumed: dict[str, Any] | None = None
    #: ``transactional=True``: the body runs in the transaction that commits its success
    transactional: bool = False


@dataclass(frozen=True)
class TaskView:
    run_id: str
    key: str
    task: str
    state: TaskState
    attempt: int
    max_attempts: int
    trigger_rule: str
    queue: str
    priority: str
    args: list[Any]
    kwargs: dict[str, Any]
    result: Any
    error: str | None
    fingerprint: str | None
    worker: str | None
    dispatched_at: dt.datetime | None
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    not_before: dt.datetime | None
    ready_at: dt.datetime | None = None
    #: why a SKIPPED task was skipped (``states.SkipReason``)
    skip_reason: str | None = None
    #: a child of a map: its map's key, its place and its key in the map (``key`` is
    #: ``map_parent[map_key]``)
    map_parent: str | None = None
    map_index: int | None = None
    map_key: str | None = None
    #: a mapped node (its children's header): {"total", "done", "succeeded", "failed",
    #: "skipped"} once it is MAPPED or closed, else None
    map_counts: dict[str, int] | None = None
    #: what a WAITING task waits for (the row's ``waiting``: ``{"kind": "event" | "sleep" |
    #: "approval" | "sensor" | "defer", "event", "match", "until", "deadline", ...}``), else None
    waiting: dict[str, Any] | None = None

    @property
    def duration(self) -> float | None:
        if self.started_at and self.finished_at:
            return (self.finished_at - self.started_at).total_seconds()
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "task": self.task,
            "state": self.state.value,
            "attempt": self.attempt,
            "max_attempts": self.max_attempts,
            "trigger_rule": self.trigger_rule,
            "queue": self.queue,
            "priority": self.priority,
            "dispatched_at": _iso(self.dispatched_at),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "not_before": _iso(self.not_before),
            "duration": self.duration,
            "worker": self.worker,
            "result": self.result,
            "error": self.error,
            "fingerprint": self.fingerprint,
            **({"skip_reason": self.skip_reason} if self.skip_reason else {}),
            **(
                {"map_parent": self.map_parent, "map_index": self.map_index, "map_key": self.map_key}
                if self.map_parent is not None
                else {}
            ),
            **({"map": self.map_counts} if self.map_counts is not None else {}),
            **({"waiting": self.waiting} if self.waiting is not None else {}),
        }


@dataclass(frozen=True)
class RunView:
    id: str
    dag: str
    tenant: str
    state: RunState
    priority: str
    idempotency_key: str | None
    params: dict[str, Any]
    task_count: int
    open_tasks: int
    created_at: dt.datetime | None
    finished_at: dt.datetime | None
    counts: dict[str, int] = field(default_factory=dict)
    #: the instant the run stands for (ISO 8601, as submitted or fired), or ``None``
    logical_date: str | None = None
    #: the name of the schedule that fired the run, or ``None``
    schedule: str | None = None
    #: the registered version of the DAG the run was made from (``submit --dag NAME[@N]``), or
    #: ``None`` (a spec or a DAG object submitted as is)
    dag_version: int | None = None
    #: the run this one runs again (``orchestrator rerun``), or ``None``
    rerun_of: str | None = None
    #: the event trigger that started the run (``orchestrator on add``), or ``None``
    trigger: str | None = None
    #: the watchdog's flag: why the run needs a person (a task no worker can take, a message
    #: re-published without a claim, no transition for too long), or ``None``
    stuck: str | None = None
    #: the run's tags (``submit(..., tags=)``, :mod:`orchestrator.core.tags`); ``{}``: none
    tags: dict[str, str] = field(default_factory=dict)
    #: keyed flow control (:mod:`orchestrator.core.flow`): the run's concurrency key, why it is
    #: held (``concurrency``, ``throttle``, ``debounce``; ``None``: not held) and until when
    flow_key: str | None = None
    held: str | None = None
    held_until: dt.datetime | None = None

    @property
    def needs_attention(self) -> bool:
        """A task parked in DEAD_LETTER, or the watchdog flagged the run (``stuck``)."""
        return self.counts.get(TaskState.DEAD_LETTER.value, 0) > 0 or self.stuck is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "dag": self.dag,
            "tenant": self.tenant,
            "state": self.state.value,
            "priority": self.priority,
            "idempotency_key": self.idempotency_key,
            "params": self.params,
            "task_count": self.task_count,
            "open_tasks": self.open_tasks,
            "counts": self.counts,
            "needs_attention": self.needs_attention,
            "stuck": self.stuck,
            "created_at": _iso(self.created_at),
            "finished_at": _iso(self.finished_at),
            "logical_date": self.logical_date,
            "schedule": self.schedule,
            "dag_version": self.dag_version,
            "rerun_of": self.rerun_of,
            "trigger": self.trigger,
            "tags": dict(self.tags),
            "concurrency_key": self.flow_key,
            "held": self.held,
            "held_until": _iso(self.held_until),
        }


@dataclass(frozen=True)
class EventView:
    """One ledger row. ``key`` is ``None`` for a transition of the run itself; ``by`` names
    the person (operator actions) on whose behalf ``actor`` acted."""

    key: str | None
    attempt: int
    from_state: str | None
    to_state: str
    actor: str
    reason: str | None
    accepted: bool
    at: dt.datetime | None
    by: str | None = None
    #: an annotation's kind (``deadline_missed``): a fact recorded, not a state change; ``None``
    #: for a transition
    kind: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "attempt": self.attempt,
            "from": self.from_state,
            "to": self.to_state,
            "actor": self.actor,
            "by": self.by,
            "reason": self.reason,
            "accepted": self.accepted,
            "at": _iso(self.at),
            "kind": self.kind,
        }


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value else None


def format_rate(per_second: float) -> str:
    for unit, seconds in (("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        n = per_second * seconds
        if n >= 1 and abs(n - round(n)) < 1e-9:
            return f"{round(n)}/{unit}"
    return f"{per_second:g}/s"


@dataclass(frozen=True)
class Pool:
    name: str
    slots: int
    #: slots held now by tasks QUEUED or RUNNING
    used: int
    description: str | None = None


@dataclass(frozen=True)
class RateLimit:
    key: str
    #: tokens per second
    rate: float
    burst: int
    #: tokens in the bucket now
    tokens: float

    @property
    def rate_text(self) -> str:
        return format_rate(self.rate)

    def next_token_in(self) -> float:
        """Seconds until the bucket holds a whole token (0 when it does)."""
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate


# ---------------------------------------------------------------------------- metrics


@dataclass(frozen=True)
class OpenTaskCount:
    """Tasks not yet terminal in one (state, queue, tenant); for READY ones, the oldest ``ready_at``."""

    state: str
    queue: str
    tenant: str
    count: int
    oldest_ready_at: dt.datetime | None = None


@dataclass(frozen=True)
class WorkerLoad:
    """A live worker (``orc_workers``): its pool size and the tasks RUNNING on it now."""

    name: str
    queues: tuple[str, ...]
    concurrency: int
    running: int
    seen_at: dt.datetime

    @property
    def free_slots(self) -> int:
        return max(self.concurrency - self.running, 0)


@dataclass(frozen=True)
class ScheduleDue:
    """An active (not paused) schedule and the next instant it should look at."""

    name: str
    tenant: str
    next_at: dt.datetime


@dataclass(frozen=True)
class WindowEvent:
    """One ledger row of the metrics window, with what its task and run rows say now
    (``task_*`` for a task event, ``run_created_at`` for every event)."""

    run_id: str
    key: str | None
    attempt: int
    from_state: str | None
    to_state: str
    actor: str
    accepted: bool
    at: dt.datetime
    reason: str | None
    tenant: str
    queue: str | None = None
    task_attempt: int | None = None
    task_ready_at: dt.datetime | None = None
    task_started_at: dt.datetime | None = None
    run_created_at: dt.datetime | None = None
    #: an annotation's kind (``states.ANNOTATIONS``: ``deadline_missed``); ``None`` for a transition
    kind: str | None = None


@dataclass(frozen=True)
class MetricsSnapshot:
    """What ``orchestrator.web.metrics`` exposes, read from the database in one connection
    (``Reads.metrics_snapshot``). Times are the database's, timezone-aware."""

    now: dt.datetime
    #: tasks not yet terminal, per (state, queue, tenant)
    open_tasks: list[OpenTaskCount]
    #: live workers (seen within the worker TTL)
    workers: list[WorkerLoad]
    #: active schedules
    schedules: list[ScheduleDue]
    #: the ledger rows of the window, oldest first
    events: list[WindowEvent]
    #: the start of the span ``events`` covers: ``now - window`` unless the row limit cut it shorter
    window_start: dt.datetime
    #: ledger rows read for the window
    events_read: int
    #: labels of the sessions holding the reconciler duty (at most one)
    reconciler_on_duty: list[str] = field(default_factory=list)
    #: deadline misses recorded in the window (not cut by the row limit): (scope, tenant) -> count,
    #: scope ``run`` or ``task``
    deadline_misses: dict[tuple[str, str], int] = field(default_factory=dict)
    #: circuit breakers: (name, mode, state, calls in the window, failures in the window)
    breakers: list[tuple[str, str, str, int, int]] = field(default_factory=list)
    #: state changes of each breaker since it was made: (name, to state) -> count
    breaker_transitions: dict[tuple[str, str], int] = field(default_factory=dict)
    #: tasks the watchdog flagged (``orc_tasks.stuck``): (kind, tenant) -> count
    stuck: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(frozen=True)
class ProgressView:
    """A running attempt's latest progress: what its body last reported with Celery's
    ``update_state(state=..., meta=...)`` (or ``current_context().progress``)."""

    key: str
    attempt: int
    state: str
    meta: Any
    updated_at: dt.datetime

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "state": self.state, "meta": self.meta, "at": self.updated_at.isoformat()}
