"""One trace per run: every message of a run carries the trace context its submitter had, whoever
publishes it; and a run's ledger written as span events (the ``otel`` extra).

**Publishing.** ``submit`` stores the caller's context on the run (``orc_runs.trace_context``,
:func:`orchestrator.engine.tracing.capture_trace_context`). A run's messages are published by the
submitter, by workers (a success's children, in the pool process) and by the reconciler (retries
and re-publishes, in a worker's main process or ``orchestrator reconcile``), each from its own
process. :class:`RunTraces` (one per app, ``app.orchestrator_lean_sender.traces``) gives each
publish the run of each message's :class:`RunTrace`: read once per run and process (one query for
the runs of a batch it does not know yet, ``Reads.trace_contexts``; kept in a bounded cache), and
only while tracing is on in the publishing process (:func:`tracing_on`: a receiver of Celery's
publish signals connected, an OpenTelemetry SDK tracer provider set, or Sentry's client active):
otherwise nothing is read and messages go out as before. Each message then

- carries the run's headers (``traceparent``, ``sentry-trace``, ``baggage``...; Sentry's also in
  the nested ``headers`` header, where its Celery integration reads them on the worker), so its
  consumer continues the run's trace even when the publisher adds nothing;
- is published with the run's context *current* (OpenTelemetry's ``context.attach``; an empty one
  for a run submitted without context: its messages start their own traces, never a child of
  whatever the publisher was doing) while ``before_task_publish`` and ``after_task_publish``
  fire: OpenTelemetry's Celery instrumentation makes its producer span a child of the
  submitter's span and injects its ``traceparent`` over the run's. (It ends that span when it
  finds the task by name in Celery's current app, as for ``send_task``: where the task modules
  are imported, as in a worker or a submitter, whose submit imports them to check names.)

**The ledger** (:func:`export_run_ledger`): one span per run, a child of the run's context (in the
run's trace, beside the attempts' spans), from its creation to its end, with one span event per
ledger row at the row's database time: rejected writes (a fenced late result, a lost claim),
re-publishes, lease expiries, waits, the watchdog's flags, deadline misses; and the state changes
of the circuit breakers its tasks use, while it ran (breakers hold tasks READY without a ledger
row of the run). A trace then shows what lost, not only what ran.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from celery import signals

from ..core.models import EventView
from ..engine.facade import Orchestrator
from .process import current_orchestrator

log = logging.getLogger(__name__)

#: Sentry's trace headers, also put in the nested ``headers`` header its worker side reads
SENTRY_HEADERS = ("sentry-trace", "baggage")
#: runs whose trace a process keeps (least recently published first out)
CACHE_SIZE = 4096
#: seconds without reads after one failed (messages meanwhile published without a context)
QUIET_SECONDS = 10.0

_before, _after = signals.before_task_publish, signals.after_task_publish


def receivers() -> bool:
    """Whether anything listens to Celery's publish signals in this process."""
    return bool(_before.receivers or _after.receivers)


def tracing_on() -> bool:
    """Whether a trace context would be used by this process's publishes: a receiver of Celery's
    publish signals (OpenTelemetry's Celery instrumentation, Datadog, ...), an OpenTelemetry SDK
    tracer provider set, or an active Sentry client. Only loaded modules are looked at."""
    if _before.receivers or _after.receivers:
        return True
    trace = sys.modules.get("opentelemetry.trace")
    if trace is not None:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
            return True
    sentry = sys.modules.get("sentry_sdk")
    return sentry is not None and bool(sentry.get_client().is_active())


def _otel() -> tuple[Any, Any] | None:
    """OpenTelemetry's ``propagate`` and ``context`` modules when its API is loaded."""
    if "opentelemetry.context" not in sys.modules:
        return None
    from opentelemetry import context, propagate  # type: ignore[attr-defined,unused-ignore]

    return propagate, context


def message_headers(carrier: Mapping[str, str] | None) -> dict[str, Any]:
    """The headers a run's messages carry for its trace context ``carrier``."""
    if not carrier:
        return {}
    headers: dict[str, Any] = dict(carrier)
    sentry = {k: carrier[k] for k in SENTRY_HEADERS if k in carrier}
    if "sentry-trace" in sentry:
        headers["headers"] = sentry  # Sentry's worker side reads the request's ``headers``
    return headers


class RunTrace:
    """The trace context of one run, as its messages carry it (:class:`orchestrator.core.publisher.RunTrace`)."""

    __slots__ = ("_context", "carrier", "headers", "send_task_headers")

    def __init__(self, carrier: Mapping[str, str] | None) -> None:
        self.carrier = dict(carrier or {})
        #: what the lean publish adds to a message's headers
        self.headers = message_headers(carrier)
        #: what ``send_task`` is given: Sentry's ``apply_async`` wrapper, when loaded, is told not
        #: to put the publisher's own Sentry trace over the run's
        self.send_task_headers = dict(self.headers)
        if "sentry-trace" in self.carrier and "sentry_sdk" in sys.modules:
            self.send_task_headers["sentry-propagate-traces"] = False
        #: OpenTelemetry's ``Context`` of the carrier, extracted on first use
        self._context: Any = None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The run's context current (OpenTelemetry's, when its API is loaded) while a message
        is published and its signals fire."""
        otel = _otel()
        if otel is None:
            yield
            return
        propagate, context = otel
        if self._context is None:
            self._context = propagate.extract(self.carrier)
        token = context.attach(self._context)
        try:
            yield
        finally:
            # also undoes a span a receiver made current and did not end (a publish that raised)
            context.detach(token)


Read = Callable[[Collection[str]], Mapping[str, Mapping[str, str] | None]]


class RunTraces:
    """Per process and app: the :class:`RunTrace` of each run it publishes for, read from the
    database once per run (``read``; default: the app's orchestrator in this process,
    ``Reads.trace_contexts``) and kept for the :data:`CACHE_SIZE` most recent runs."""

    def __init__(self, app: Any, read: Read | None = None, size: int = CACHE_SIZE) -> None:
        self.app = app
        self.read: Read = read or self._read
        self.size = size
        self._cache: OrderedDict[str, RunTrace] = OrderedDict()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        #: queries made (the tests and the bench count them)
        self.reads = 0
        #: after a read fails, none is tried before this ``time.monotonic()``
        self._quiet_until = 0.0

    def _read(self, run_ids: Collection[str]) -> Mapping[str, Mapping[str, str] | None]:
        return current_orchestrator(self.app).store.reads.trace_contexts(run_ids)

    def bound(self, read: Read) -> RunTraces:
        """Another cache of the same app that reads with ``read`` (an orchestrator's own store:
        a submitter whose database is not the app's default one)."""
        return RunTraces(self.app, read=read, size=self.size)

    def lookup(self, run_ids: Collection[str]) -> dict[str, RunTrace] | None:
        """The runs' traces; ``None`` while tracing is off in this process (:func:`tracing_on`).
        A read that fails is logged and its runs published without a context; none is tried for
        :data:`QUIET_SECONDS` after (so an outage does not hold every publish back)."""
        if not tracing_on():
            return None
        if self._pid != os.getpid():  # a forked child: a lock of its own (the parent's may be held)
            self._lock, self._pid = threading.Lock(), os.getpid()
        found: dict[str, RunTrace] = {}
        with self._lock:
            for run_id in run_ids:
                hit = self._cache.get(run_id)
                if hit is not None:
                    self._cache.move_to_end(run_id)
                    found[run_id] = hit
        missing = [r for r in run_ids if r not in found]
        if not missing or time.monotonic() < self._quiet_until:
            return found
        try:
            self.reads += 1
            carriers = self.read(missing)
        except Exception:
            self._quiet_until = time.monotonic() + QUIET_SECONDS
            log.warning("reading the trace context of %d run(s) failed; published without", len(missing), exc_info=True)
            return found
        with self._lock:
            for run_id in missing:
                found[run_id] = self._cache[run_id] = RunTrace(carriers.get(run_id))
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return found

    def forget(self) -> None:
        """Drop every run's trace (a test, or a forked child that wants a clean slate)."""
        with self._lock:
            self._cache.clear()


# ------------------------------------------------------------------ the ledger as span events


def _ns(at: dt.datetime | None) -> int | None:
    """A time as OpenTelemetry's nanoseconds since the epoch."""
    if at is None:
        return None
    return int(at.timestamp()) * 1_000_000_000 + at.microsecond * 1000


def event_name(e: EventView) -> str:
    """What a ledger row says, as a span event's name: what lost first."""
    if not e.accepted:
        return "orchestrator.rejected"
    if e.kind:
        return f"orchestrator.{e.kind}"
    if e.key is None:
        return "orchestrator.run"
    if e.from_state == e.to_state == "QUEUED":
        return "orchestrator.republished"
    if e.from_state == "RUNNING" and e.actor == "reconciler" and e.to_state in ("RETRYING", "FAILED", "DEAD_LETTER"):
        return "orchestrator.lease_expired"
    if "WAITING" in (e.from_state, e.to_state):
        return "orchestrator.wait"
    return "orchestrator.transition"


def event_attributes(e: EventView) -> dict[str, Any]:
    """A ledger row's fields as span event attributes (``orchestrator.*``; no null values)."""
    values = {
        "key": e.key,
        "attempt": e.attempt,
        "from": e.from_state,
        "to": e.to_state,
        "actor": e.actor,
        "by": e.by,
        "reason": e.reason,
        "accepted": e.accepted,
        "kind": e.kind,
    }
    return {f"orchestrator.{k}": v for k, v in values.items() if v is not None}


def export_run_ledger(orc: Orchestrator, run_id: str, tracer: Any = None) -> Any:
    """Write run ``run_id``'s ledger to OpenTelemetry (see the module's docstring) and return the
    ended span. ``tracer``: default, the global provider's ``orchestrator`` tracer. Raises
    :class:`RunNotFound` for a run ``orc`` may not see; needs ``opentelemetry-api`` (the
    ``otel`` extra) and, to export, an SDK."""
    from opentelemetry import context, propagate, trace  # type: ignore[attr-defined,unused-ignore]

    view = orc.reads.get_run(run_id)
    events = orc.reads.events(run_id)
    carrier = orc.reads.trace_contexts([run_id]).get(run_id)
    parent = propagate.extract(carrier) if carrier else context.Context()
    tracer = tracer or trace.get_tracer("orchestrator")
    attributes = {
        "orchestrator.run_id": run_id,
        "orchestrator.dag": view.dag,
        "orchestrator.tenant": view.tenant,
        "orchestrator.state": view.state.value,
        "orchestrator.tasks": view.task_count,
    }
    span = tracer.start_span(
        f"orchestrator.run {view.dag}", context=parent, start_time=_ns(view.created_at), attributes=attributes
    )
    for e in events:
        span.add_event(event_name(e), event_attributes(e), timestamp=_ns(e.at))
    # the run's end, or a later row (a late result rejected after it ended)
    end = max((t for t in (view.finished_at, *(e.at for e in events)) if t is not None), default=None)
    for b in _breaker_events(orc, run_id, view.created_at, end):
        attrs = {"orchestrator.breaker": b.name, "orchestrator.from": b.from_state, "orchestrator.to": b.to_state,
                 "orchestrator.actor": b.actor, "orchestrator.reason": b.reason}  # fmt: skip
        span.add_event("orchestrator.breaker", {k: v for k, v in attrs.items() if v is not None}, timestamp=_ns(b.at))
    if view.state.value == "FAILED":
        span.set_status(trace.Status(trace.StatusCode.ERROR, "run failed"))
    span.end(end_time=_ns(end) or time.time_ns())
    return span


def _breaker_events(orc: Orchestrator, run_id: str, start: dt.datetime | None, end: dt.datetime | None) -> list[Any]:
    """The state changes of the breakers of the run's resources between ``start`` and ``end``
    (the deployment's breakers: none for a tenant-bound orchestrator)."""
    if orc.tenant is not None or start is None:
        return []
    found = []
    for name in orc.reads.run_resources(run_id):
        for b in orc.store.breakers.events(name, limit=1000):
            if start <= b.at and (end is None or b.at <= end):
                found.append(b)
    return sorted(found, key=lambda b: b.at)
