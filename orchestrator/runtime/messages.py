"""The lean publish: Celery task messages (protocol 2) stamped from a template.

``send_task`` builds each message from scratch: it routes the task through ``task_routes``,
checks its arguments, renders their repr and binds the queue again to check that it was
declared. A dispatch already names its queue, and most messages of one task name differ only in
their id, time limits and fencing headers, so :class:`LeanSender` keeps the constant headers of
each task name (``as_task_v2``'s) and stamps a copy per attempt, declares each queue once per
channel, and hands the message to kombu's ``Producer.publish`` with the app's serializer,
compression and publish retry policy.

Like ``send_task`` it sends Celery's ``before_task_publish`` and ``after_task_publish`` with the
arguments ``amqp.send_task_message`` gives them (the headers mutable: what a receiver adds is in
the message; ``declare`` is ``[queue]`` as there, though the queue is declared once per channel),
but only when a receiver is connected: with none the arguments are not built. A message of a
traced run carries the run's trace context and is published with that context current
(:mod:`orchestrator.runtime.tracing`): OpenTelemetry's, Sentry's and other Celery
instrumentations see it as their own publish, in the run's trace.

``tests/unit/test_publisher.py`` holds its messages equal to ``send_task``'s on Redis and
RabbitMQ (``tests/unit/test_trace_publish.py`` the signals' arguments); ``bench/publish.py``
measures both. ``create_app`` attaches one to each app it makes (``app.orchestrator_lean_sender``),
for :class:`orchestrator.core.publisher.CeleryPublisher`, with the app's
:class:`~orchestrator.runtime.tracing.RunTraces` (``.traces``).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

from celery import signals
from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr

from ..core.models import Dispatch
from ..core.protocol import HEADER_ATTEMPT, HEADER_DIRECT, HEADER_KEY, HEADER_RUN, HEADER_SIGNATURE
from ..core.publisher import RunTrace
from .tracing import RunTraces

#: the body's third item: no callbacks, errbacks, chain or chord
_EMBED: dict[str, Any] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}

_before, _after = signals.before_task_publish, signals.after_task_publish


class LeanSender:
    """Publishes orchestrated task messages as ``send_task`` would, stamped from a per-task-name
    template: the same headers, properties and body (``tests/unit/test_publisher.py``), Celery's
    publish signals when a receiver is connected, and the run's trace context (``traces``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        conf = app.conf
        self._options = {
            "serializer": conf.task_serializer,
            "compression": conf.task_compression,
            "retry": conf.task_publish_retry,
            "retry_policy": dict(conf.task_publish_retry_policy or {}),
        }
        self._delivery_mode = conf.task_default_delivery_mode
        self._repr_max = (app.amqp.argsrepr_maxsize, app.amqp.kwargsrepr_maxsize)
        self._empty_repr = (saferepr(()), saferepr({}))
        #: per task name, the headers no attempt changes; made again in a forked child (origin)
        self._headers: dict[str, dict[str, Any]] = {}
        self._pid = os.getpid()
        self._queues: dict[str, tuple[Any, Any]] = {}
        #: the queues declared on each channel (forgotten with the channel)
        self._declared: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
        #: each run's trace context, for the runs this process publishes for
        self.traces = RunTraces(app)

    def send(
        self, producer: Any, d: Dispatch, signature: str, priority: int | None, trace: RunTrace | None = None
    ) -> None:
        """Publish ``d``'s message (signed with ``signature``) on ``producer``; ``trace``: its run's
        trace context (:meth:`RunTraces.lookup`), ``None`` while tracing is off here."""
        token = d.token
        task_id = token.task_id
        headers = self._constant(d.task_name).copy()
        headers["id"] = headers["root_id"] = task_id
        parent = self.app.current_worker_task  # published from a worker's task: Celery's lineage
        if parent is not None:
            headers["root_id"] = parent.request.root_id or parent.request.id
            headers["parent_id"] = parent.request.id
        headers["timelimit"] = [d.time_limit, d.soft_time_limit]
        if d.args or d.kwargs:
            levels = self.app.conf.task_repr_maxlevels
            headers["argsrepr"] = saferepr(d.args, self._repr_max[0], maxlevels=levels)
            headers["kwargsrepr"] = saferepr(d.kwargs, self._repr_max[1], maxlevels=levels)
        headers[HEADER_RUN] = token.run_id
        headers[HEADER_KEY] = token.key
        headers[HEADER_ATTEMPT] = token.attempt
        headers[HEADER_SIGNATURE] = signature
        if d.direct:
            headers[HEADER_DIRECT] = True
        if trace is not None:
            headers.update(trace.headers)
        queue, delivery_mode = self._queue(d.queue)
        # declared once per channel (kombu's own check copies and binds the queue every time)
        declared = self._declared.get(producer.channel)
        if declared is None:
            declared = self._declared[producer.channel] = set()
        properties: dict[str, Any] = {"correlation_id": task_id, "reply_to": self.app.thread_oid}
        if priority is not None:
            properties["priority"] = priority
        declare = [] if d.queue in declared else [queue]
        if _before.receivers or _after.receivers:
            self._signalled(producer, d, queue, declare, delivery_mode, headers, properties, trace)
        else:
            producer.publish(
                (d.args or (), d.kwargs or {}, _EMBED),
                exchange="",
                routing_key=d.queue,
                declare=declare,
                delivery_mode=delivery_mode,
                headers=headers,
                **self._options,
                **properties,
            )
        declared.add(d.queue)

    def _signalled(
        self,
        producer: Any,
        d: Dispatch,
        queue: Any,
        declare: list[Any],
        delivery_mode: Any,
        headers: dict[str, Any],
        properties: dict[str, Any],
        trace: RunTrace | None,
    ) -> None:
        """Publish with ``before_task_publish`` and ``after_task_publish`` around it, given what
        ``send_task`` gives them (a body, a retry policy and ``declare`` of this message's own),
        under the run's trace context."""
        body = (d.args or (), d.kwargs or {}, dict(_EMBED))
        options = dict(self._options, retry_policy=dict(self._options["retry_policy"]))
        with trace.active() if trace is not None else contextlib.nullcontext():
            _before.send(
                sender=d.task_name,
                body=body,
                exchange="",
                routing_key=d.queue,
                declare=[queue],
                headers=headers,
                properties=properties,
                retry_policy=options["retry_policy"],
            )
            producer.publish(
                body,
                exchange="",
                routing_key=d.queue,
                declare=declare,
                delivery_mode=delivery_mode,
                headers=headers,
                **options,
                **properties,
            )
            _after.send(sender=d.task_name, body=body, headers=headers, exchange="", routing_key=d.queue)

    def _constant(self, task_name: str) -> dict[str, Any]:
        """``as_task_v2``'s headers of ``task_name`` that no attempt changes."""
        if self._pid != os.getpid():  # a forked child: its own origin
            self._headers, self._pid = {}, os.getpid()
        headers = self._headers.get(task_name)
        if headers is None:
            headers = self._headers[task_name] = {
                "lang": "py",
                "task": task_name,
                "id": None,
                "shadow": None,
                "eta": None,
                "expires": None,
                "group": None,
                "group_index": None,
                "retries": 0,
                "timelimit": [None, None],
                "root_id": None,
                "parent_id": None,
                "argsrepr": self._empty_repr[0],
                "kwargsrepr": self._empty_repr[1],
                "origin": anon_nodename(),
                "ignore_result": None,
                "replaced_task_nesting": 0,
                "stamped_headers": None,
                "stamps": {},
            }
        return headers

    def _queue(self, name: str) -> tuple[Any, Any]:
        """The app's queue ``name`` (made when missing, as ``send_task`` does) and its delivery mode."""
        hit = self._queues.get(name)
        if hit is None:
            queue = self.app.amqp.queues[name]
            mode = getattr(queue.exchange, "delivery_mode", None) or self._delivery_mode
            hit = self._queues[name] = (queue, mode)
        return hit
