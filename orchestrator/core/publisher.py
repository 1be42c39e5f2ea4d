"""The publisher seam: how committed dispatches leave the process.

The engine, the reconciler and the worker hand :class:`~orchestrator.core.models.Dispatch` values
to a :class:`Publisher` only *after* the transaction that made them QUEUED has committed.
Production publishes Celery messages (:class:`CeleryPublisher`); unit tests record them in
memory (:class:`RecordingPublisher`) and run the engine and the reconciler without a broker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from .crashpoints import crash_point
from .models import Dispatch
from .protocol import message_priority, send_options, sign

log = logging.getLogger(__name__)


class Publisher(Protocol):
    """Sends one message per dispatch, and revokes attempts in flight."""

    def publish(self, dispatches: Sequence[Dispatch]) -> int:
        """Send every dispatch; return how many were sent. Must not raise: a dispatch that
        was not sent stays QUEUED in the database and the reconciler re-publishes it."""
        ...

    def revoke(self, task_ids: Sequence[str]) -> None:
        """Ask the workers to stop these attempts (best effort: their results are fenced)."""
        ...


class RecordingPublisher:
    """An in-memory publisher for tests: ``sent`` holds every dispatch, ``revoked`` every id.

    ``fail_next`` makes the next ``publish`` call send nothing (a broker outage)."""

    def __init__(self) -> None:
        self.sent: list[Dispatch] = []
        self.revoked: list[str] = []
        self.fail_next = False
        self._lock = threading.Lock()

    def publish(self, dispatches: Sequence[Dispatch]) -> int:
        with self._lock:
            if self.fail_next:
                self.fail_next = False
                return 0
            self.sent.extend(dispatches)
            return len(dispatches)

    def revoke(self, task_ids: Sequence[str]) -> None:
        with self._lock:
            self.revoked.extend(task_ids)

    def take(self) -> list[Dispatch]:
        """Return and forget what was sent so far."""
        with self._lock:
            sent, self.sent = self.sent, []
            return sent


class RunTrace(Protocol):
    """One run's trace context as its messages carry it (``orchestrator.runtime.tracing.RunTrace``)."""

    #: what the lean publish adds to a message's headers for the run's trace context
    headers: Mapping[str, Any]
    #: what ``send_task`` is given in its ``headers`` for it
    send_task_headers: Mapping[str, Any]

    def active(self) -> AbstractContextManager[None]:
        """The run's context current while one message is published and its signals fire."""
        ...


class RunTraces(Protocol):
    """Each run's trace context, for the runs a publish is for (``orchestrator.runtime.tracing.RunTraces``)."""

    def lookup(self, run_ids: Collection[str]) -> Mapping[str, RunTrace] | None:
        """The runs' traces, or ``None`` while tracing is off in this process. Must not raise."""
        ...

    def bound(self, read: Callable[[Collection[str]], Mapping[str, Any]]) -> RunTraces:
        """The same, reading each run's context with ``read``."""
        ...


class LeanSender(Protocol):
    """Publishes one dispatch's task message on a producer (``orchestrator.runtime.messages.LeanSender``)."""

    traces: RunTraces

    def send(
        self, producer: Any, d: Dispatch, signature: str, priority: int | None, trace: RunTrace | None = None
    ) -> None: ...


class CeleryPublisher:
    """Publishes one Celery task message per dispatch, on one producer per batch.

    The message is the one ``send_task`` would make. An app made by
    :func:`orchestrator.runtime.celery_app.create_app` carries a lean sender
    (:class:`orchestrator.runtime.messages.LeanSender`: the message's constant part built once per task
    name and stamped per attempt, without ``send_task``'s routing and checks; Celery's publish
    signals sent as ``send_task`` sends them), used unless task-sent events are on
    (``ORCHESTRATOR_TASK_EVENTS``: Flower's "sent" state, which ``send_task`` emits); any other
    app publishes through ``send_task``.

    Either way each message carries its run's trace context and is published with it current
    (``traces``: default, the lean sender's :class:`orchestrator.runtime.tracing.RunTraces`,
    reading with ``trace_read`` when given (the orchestrator's own store); ``None`` for an app
    without one), so the run is one trace whoever publishes it.

    ``signing_key`` returns the deployment's key (read from the database once, by the store):
    each message's fencing headers carry their signature (:func:`orchestrator.core.protocol.sign`).
    On RabbitMQ each message also carries its priority class as a message priority (on Redis,
    kombu would turn a priority into separate lists: admission's order is enough there)."""

    def __init__(
        self,
        app: Any,
        signing_key: Callable[[], bytes],
        traces: RunTraces | None = None,
        trace_read: Callable[[Collection[str]], Mapping[str, Any]] | None = None,
    ) -> None:
        self.app = app
        self.signing_key = signing_key
        self.priorities = broker_has_priorities(str(app.conf.broker_url or ""))
        sender: LeanSender | None = getattr(app, "orchestrator_lean_sender", None)
        #: the lean sender, or ``None``: every message through ``send_task``
        self.lean: LeanSender | None = None if app.conf.task_send_sent_event else sender
        #: each run's trace context (``None``: messages carry none)
        self.traces: RunTraces | None = traces if traces is not None else getattr(sender, "traces", None)
        if traces is None and self.traces is not None and trace_read is not None:
            self.traces = self.traces.bound(trace_read)  # the caller's own database, not the app's

    def publish(self, dispatches: Sequence[Dispatch]) -> int:
        batch = list(dispatches)
        if not batch:
            return 0
        crash_point("after_dispatch_commit")
        sent = queued = 0
        traces = self.traces.lookup({d.run_id for d in batch}) if self.traces is not None else None
        try:
            key = self.signing_key()
            with self.app.producer_or_acquire() as producer:
                # several messages go to Redis in one pipeline (kombu >= 5.7's producer batch: one
                # round trip instead of one per message); elsewhere one by one
                group = getattr(producer, "batch", None) if len(batch) > 1 else None
                with group() if group is not None else contextlib.nullcontext():
                    for d in batch:
                        signature = sign(key, d.task_name, d.token, (d.args, d.kwargs) if d.direct else None)
                        priority = message_priority(d.priority_rank) if self.priorities else None
                        trace = traces.get(d.run_id) if traces is not None else None
                        if self.lean is not None:
                            self.lean.send(producer, d, signature, priority, trace)
                        else:
                            self._send_task(producer, d, signature, priority, trace)
                        queued += 1
                        if group is None:
                            sent = queued
                sent = queued
        except Exception:
            log.exception(
                "publish failed after %d of %d messages; the reconciler re-publishes the rest", sent, len(batch)
            )
        return sent

    def _send_task(
        self, producer: Any, d: Dispatch, signature: str, priority: int | None, trace: RunTrace | None = None
    ) -> None:
        options = send_options(
            d.token,
            queue=d.queue,
            soft_time_limit=d.soft_time_limit,
            time_limit=d.time_limit,
            signature=signature,
            priority=priority,
            direct=d.direct,
        )
        if trace is not None:
            options["headers"].update(trace.send_task_headers)
        with trace.active() if trace is not None else contextlib.nullcontext():
            self.app.send_task(d.task_name, args=d.args, kwargs=d.kwargs, producer=producer, **options)

    def revoke(self, task_ids: Iterable[str]) -> None:
        ids = list(task_ids)
        if not ids:
            return
        try:
            self.app.control.revoke(ids, terminate=True, signal="SIGTERM")
        except Exception:
            log.exception("revoking %d task(s) failed; their results will be rejected", len(ids))


def broker_has_priorities(url: str) -> bool:
    """Whether the broker carries message priorities natively (AMQP: RabbitMQ)."""
    return url.split("://", 1)[0] in ("amqp", "amqps", "pyamqp")
