"""The project's Celery app: JSON only, late acks, one message per attempt, results ignored (the
database holds them; the result backend only answers ``AsyncResult`` of an attempt from there).

Importing this module connects the worker's signal handlers (``orchestrator.runtime.worker``): on
``worker_ready`` a worker registers its capacity and starts its reconciler service.

``celery -A config.celery_app worker`` and ``orchestrator worker`` both use :func:`get_app`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import Any

from celery import Celery, signals
from kombu.entity import Exchange, Queue

from ..core.config import Settings
from ..core.errors import ConfigurationError
from ..core.protocol import MAX_MESSAGE_PRIORITY
from ..core.publisher import broker_has_priorities
from ..core.routing import default_queues
from ..engine.facade import Orchestrator
from . import worker as _worker_signals  # noqa: F401 - connects the worker's signal handlers

log = logging.getLogger(__name__)

#: seconds of slack required between the longest hard time limit and the visibility timeout
VISIBILITY_MARGIN = 60.0


def create_app(settings: Settings | None = None, *, main: str | None = None) -> Celery:
    """A Celery app configured for orchestrated tasks from ``settings`` (default: environment).

    ``main`` (Celery's: the name tasks defined in the script being run get instead of
    ``__main__``) defaults to the script's own module when ``ORCHESTRATOR_TASK_MODULES`` lists it
    (``python myflow.py`` with ``myflow`` listed: its tasks are ``myflow.extract``, the names the
    workers register), else ``orchestrator``."""
    settings = settings or Settings.from_env()
    main = main or script_module(settings.task_modules) or "orchestrator"
    os.makedirs(settings.data_dir, exist_ok=True)
    transport_options = settings.broker_transport_options()
    for option in ("data_folder_in", "processed_folder"):
        if option in transport_options:
            os.makedirs(transport_options[option], exist_ok=True)
    if settings.broker_url.startswith("filesystem"):
        from . import fsbroker

        fsbroker.register()  # an atomic publish (kombu's can be read half written)
    if settings.broker_url.startswith(("redis:", "rediss:")):
        from . import redisbroker

        redisbroker.register()  # one client object per channel, not one per command
    app = Celery(
        main,
        broker=settings.broker_url,
        task_cls="orchestrator.runtime.worker:OrchestratedTask",
        include=list(settings.task_modules),
        set_as_current=False,
    )
    queues = default_queues(settings.dedicated_tenants)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        # stores nothing; answers AsyncResult(id).state/.info of an orchestrated attempt from the database
        result_backend="orchestrator.runtime.results:OrchestratorBackend",
        # every message's envelope is checked before Celery handles it (orchestrator.inbox)
        worker_consumer="orchestrator.runtime.inbox:GuardedConsumer",
        # off by default: 4 of the ~14 Redis commands of a task; Flower enables worker events
        # with a broadcast when it starts (its --enable_events, on by default)
        worker_send_task_events=settings.task_events,
        task_send_sent_event=settings.task_events,
        task_time_limit=settings.max_time_limit,
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        task_default_queue=queues[1],
        task_queues=[Queue(q, Exchange(q, type="direct"), routing_key=q) for q in queues],
        task_create_missing_queues=True,
        # RabbitMQ: priority queues, so a message's priority class orders what waits in a queue
        # (publisher.CeleryPublisher sets it); an existing queue declared without it must be
        # deleted once (RabbitMQ refuses to redeclare a queue with other arguments)
        task_queue_max_priority=MAX_MESSAGE_PRIORITY if broker_has_priorities(settings.broker_url) else None,
        # beat is for schedules; the reconciler runs beside the workers' pools, not as a task
        beat_schedule={},
        beat_schedule_filename=os.path.join(settings.data_dir, "celerybeat-schedule"),
        timezone="UTC",
        enable_utc=True,
    )
    app.orchestrator_settings = settings
    # the lean publish (orchestrator.publisher.CeleryPublisher uses it)
    from .messages import LeanSender

    app.orchestrator_lean_sender = LeanSender(app)
    return app


def check_worker_settings(app: Celery) -> None:
    """Refuse settings under which redelivery could run a task twice or load pickle, or under
    which the reconciler's duty would go through a transaction pooler.

    Raises :class:`ConfigurationError` naming what to set.
    """
    conf = app.conf
    settings = getattr(app, "orchestrator_settings", None)
    if (
        settings is not None
        and settings.worker_reconciler
        and settings.db_transaction_pooler
        and not settings.db_direct_url
    ):
        raise ConfigurationError(
            "ORCHESTRATOR_DB_TRANSACTION_POOLER is on and the worker runs the reconciler, whose duty is a session"
            " advisory lock a transaction pooler cannot hold: set ORCHESTRATOR_DB_DIRECT_URL to a URL straight to"
            " Postgres, or ORCHESTRATOR_WORKER_RECONCILER=0 (and run `orchestrator reconcile` with a direct URL)"
        )
    if set(conf.accept_content or ()) - {"json", "application/json"}:
        raise ConfigurationError(f"accept_content is {conf.accept_content!r}: the orchestrator accepts JSON only")
    url = str(conf.broker_url or "")
    if url.startswith(("redis", "rediss", "sentinel", "sqs")):
        vt = float((conf.broker_transport_options or {}).get("visibility_timeout", 3600))
        longest = float(conf.task_time_limit or 0)
        if not conf.task_time_limit:
            raise ConfigurationError("task_time_limit is unset: every task needs a hard time limit")
        if vt < longest + VISIBILITY_MARGIN:
            raise ConfigurationError(
                f"broker visibility_timeout {vt:g}s must exceed the longest hard time limit"
                f" {longest:g}s by {VISIBILITY_MARGIN:g}s: raise ORCHESTRATOR_VISIBILITY_TIMEOUT"
                " or lower ORCHESTRATOR_MAX_TIME_LIMIT"
            )


@signals.worker_init.connect
def _refuse_unsafe_worker(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not hasattr(app, "orchestrator_settings"):
        return
    try:
        check_worker_settings(app)
    except ConfigurationError as exc:
        # signal receivers' exceptions are swallowed; SystemExit is not
        raise SystemExit(f"orchestrator: refusing to start the worker: {exc}") from None


_app: Celery | None = None


def get_app() -> Celery:
    """The process-wide default app, built from the environment on first use."""
    global _app
    if _app is None:
        _app = create_app()
    return _app


_default: Orchestrator | None = None


def default_orchestrator() -> Orchestrator:
    """The process-wide :class:`Orchestrator` of :func:`get_app` (:func:`orchestrator.default`, the
    CLI), made on first use."""
    global _default
    if _default is None:
        _default = Orchestrator(app=get_app())
    return _default


def script_module(task_modules: tuple[str, ...]) -> str | None:
    """The module of ``task_modules`` that the script being run (``__main__``) is, if any."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path:
        return None
    for name in task_modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        origin = getattr(spec, "origin", None)
        if origin and os.path.exists(origin) and os.path.exists(path) and os.path.samefile(origin, path):
            return name
    return None
