"""The lean publish: Celery task messages (protocol 2) stamped from a template.

``send_task`` builds each message from scratch: it routes the task through ``task_routes``,
checks its arguments, renders their repr, sends the ``before/after_task_publish`` signals and
binds the queue again to check that it was declared. A dispatch already names its queue, and
most messages of one task name differ only in their id, time limits and fencing headers, so
:class:`LeanSender` keeps the constant headers of each task name (``as_task_v2``'s) and stamps a
copy per attempt, declares each queue once per channel, and hands the message to kombu's
``Producer.publish`` with the app's serializer, compression and publish retry policy.
``tests/unit/test_publisher.py`` holds its messages equal to ``send_task``'s on Redis and
RabbitMQ; ``bench/publish.py`` measures both. ``create_app`` attaches one to each app it makes
(``app.orchestrator_lean_sender``), for :class:`orchestrator.core.publisher.CeleryPublisher`.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from celery.utils.nodenames import anon_nodename
from celery.utils.saferepr import saferepr

from ..core.models import Dispatch
from ..core.protocol import HEADER_ATTEMPT, HEADER_DIRECT, HEADER_KEY, HEADER_RUN, HEADER_SIGNATURE

#: the body's third item: no callbacks, errbacks, chain or chord
_EMBED: dict[str, Any] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


class LeanSender:
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

    def send(self, producer: Any, d: Dispatch, signature: str, priority: int | None) -> None:
        """Publish ``d``'s message (signed with ``signature``) on ``producer``."""
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
        queue, delivery_mode = self._queue(d.queue)
        # declared once per channel (kombu's own check copies and binds the queue every time)
        declared = self._declared.get(producer.channel)
        if declared is None:
            declared = self._declared[producer.channel] = set()
        options: dict[str, Any] = {}
        if priority is not None:
            options["priority"] = priority
        producer.publish(
            (d.args or (), d.kwargs or {}, _EMBED),
            exchange="",
            routing_key=d.queue,
            declare=[] if d.queue in declared else [queue],
            delivery_mode=delivery_mode,
            headers=headers,
            correlation_id=task_id,
            reply_to=self.app.thread_oid,
            **self._options,
            **options,
        )
        declared.add(d.queue)

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
