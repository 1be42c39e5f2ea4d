"""The publisher seam: how committed dispatches leave the process.

The engine, the reconciler and the worker hand :class:`~orchestrator.models.Dispatch` values
to a :class:`Publisher` only *after* the transaction that made them QUEUED has committed.
Production publishes Celery messages (:class:`CeleryPublisher`); unit tests record them in
memory (:class:`RecordingPublisher`) and run the engine and the reconciler without a broker.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from celery.utils.saferepr import saferepr

from .crashpoints import crash_point
from .models import Dispatch
from .protocol import HEADER_ATTEMPT, HEADER_KEY, HEADER_RUN, HEADER_SIGNATURE, message_priority, send_options, sign

log = logging.getLogger(__name__)

#: Celery's ``argsrepr_maxsize`` and ``kwargsrepr_maxsize`` (``app.amqp``)
ARGSREPR_MAXSIZE = 1024
#: the body's third item: no callbacks, errbacks, chain or chord
_EMBED: dict[str, Any] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
_EMPTY_ARGSREPR, _EMPTY_KWARGSREPR = saferepr(()), saferepr({})


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


class CeleryPublisher:
    """Publishes Celery task messages (protocol 2) for the dispatches, on one producer per batch.

    The lean publish: a message's constant part (the protocol's headers of a task name, the
    body of empty arguments, the queue's routing) is built once and stamped per attempt with its
    id, time limits and fencing headers, then handed to kombu's ``Producer.publish`` with the
    app's serializer, compression and publish retry policy. What ``send_task`` adds per message
    (routing through ``task_routes``, the ``before/after_task_publish`` signals, argument checks)
    is left out: a dispatch names its queue, and its arguments come from the database. With
    ``task_send_sent_event`` on (``ORCHESTRATOR_TASK_EVENTS``: Flower's "sent" state) messages go
    through ``send_task`` as before. ``tests/unit/test_publisher.py`` holds both messages equal.

    ``signing_key`` returns the deployment's key (read from the database once, by the store):
    each message's fencing headers carry their signature (:func:`orchestrator.protocol.sign`).
    On RabbitMQ each message also carries its priority class as a message priority (on Redis,
    kombu would turn a priority into separate lists: admission's order is enough there)."""

    def __init__(self, app: Any, signing_key: Callable[[], bytes]) -> None:
        self.app = app
        self.signing_key = signing_key
        self.priorities = broker_has_priorities(str(app.conf.broker_url or ""))
        conf = app.conf
        #: False: every message through ``send_task`` (task-sent events wanted)
        self.lean = not conf.task_send_sent_event
        self._publish_options = {
            "serializer": conf.task_serializer,
            "compression": conf.task_compression,
            "retry": conf.task_publish_retry,
            "retry_policy": dict(conf.task_publish_retry_policy or {}),
        }
        self._delivery_mode = conf.task_default_delivery_mode
        self._headers: dict[str, dict[str, Any]] = {}
        self._queues: dict[str, tuple[Any, Any]] = {}
        self._origin: str | None = None
        #: the queues declared on each channel (forgotten with the channel)
        self._declared: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()

    def publish(self, dispatches: Sequence[Dispatch]) -> int:
        batch = list(dispatches)
        if not batch:
            return 0
        crash_point("after_dispatch_commit")
        sent = 0
        try:
            key = self.signing_key()
            send = self._send if self.lean else self._send_task
            with self.app.producer_or_acquire() as producer:
                for d in batch:
                    send(producer, d, key)
                    sent += 1
        except Exception:
            log.exception(
                "publish failed after %d of %d messages; the reconciler re-publishes the rest", sent, len(batch)
            )
        return sent

    def _send_task(self, producer: Any, d: Dispatch, key: bytes) -> None:
        self.app.send_task(
            d.task_name,
            args=d.args,
            kwargs=d.kwargs,
            producer=producer,
            **send_options(
                d.token,
                queue=d.queue,
                soft_time_limit=d.soft_time_limit,
                time_limit=d.time_limit,
                signature=sign(key, d.task_name, d.token),
                priority=message_priority(d.priority_rank) if self.priorities else None,
            ),
        )

    def _send(self, producer: Any, d: Dispatch, key: bytes) -> None:
        token = d.token
        task_id = token.task_id
        headers = self._headers.get(d.task_name)
        if headers is None:
            headers = self._headers[d.task_name] = self._constant_headers(d.task_name)
        headers = headers.copy()
        headers["id"] = headers["root_id"] = task_id
        parent = self.app.current_worker_task  # published by a worker's task: Celery's lineage
        if parent is not None:
            headers["root_id"] = parent.request.root_id or parent.request.id
            headers["parent_id"] = parent.request.id
        headers["timelimit"] = [d.time_limit, d.soft_time_limit]
        if d.args or d.kwargs:
            levels = self.app.conf.task_repr_maxlevels
            headers["argsrepr"] = saferepr(d.args, ARGSREPR_MAXSIZE, maxlevels=levels)
            headers["kwargsrepr"] = saferepr(d.kwargs, ARGSREPR_MAXSIZE, maxlevels=levels)
        headers[HEADER_RUN] = token.run_id
        headers[HEADER_KEY] = token.key
        headers[HEADER_ATTEMPT] = token.attempt
        headers[HEADER_SIGNATURE] = sign(key, d.task_name, token)
        queue, delivery_mode = self._queue(d.queue)
        # declared once per channel (kombu's own check copies and binds the queue every time)
        declared = self._declared.get(producer.channel)
        if declared is None:
            declared = self._declared[producer.channel] = set()
        declare = [] if d.queue in declared else [queue]
        options: dict[str, Any] = {}
        if self.priorities:
            options["priority"] = message_priority(d.priority_rank)
        producer.publish(
            (d.args, d.kwargs, _EMBED),
            exchange="",
            routing_key=d.queue,
            declare=declare,
            delivery_mode=delivery_mode,
            headers=headers,
            correlation_id=task_id,
            reply_to=self.app.thread_oid,
            **self._publish_options,
            **options,
        )
        declared.add(d.queue)

    def _constant_headers(self, task_name: str) -> dict[str, Any]:
        """Protocol 2's headers of ``task_name`` that no attempt changes (``as_task_v2``'s)."""
        if self._origin is None:
            from celery.utils.nodenames import anon_nodename

            self._origin = anon_nodename()
        return {
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
            "argsrepr": _EMPTY_ARGSREPR,
            "kwargsrepr": _EMPTY_KWARGSREPR,
            "origin": self._origin,
            "ignore_result": None,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        }

    def _queue(self, name: str) -> tuple[Any, Any]:
        """The app's queue ``name`` (made when missing, as ``send_task`` does) and its delivery mode."""
        hit = self._queues.get(name)
        if hit is None:
            queue = self.app.amqp.queues[name]
            mode = getattr(queue.exchange, "delivery_mode", None) or self._delivery_mode
            hit = self._queues[name] = (queue, mode)
        return hit

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
