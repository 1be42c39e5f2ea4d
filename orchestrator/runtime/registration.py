"""A worker's registration: the registry row that advertises its capacity, queues and task names
(kept fresh by a heartbeat thread), the reconciler service beside it, and the worker signals that
start and stop them (connected on import: :mod:`orchestrator.runtime.worker` imports this)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery, signals

from ..core.registry import RESERVED_PREFIXES
from ..engine.facade import Orchestrator
from ..services.reconciler import ReconcilerService
from .process import all_orchestrators, current_orchestrator

log = logging.getLogger(__name__)


class WorkerServices:
    """What runs in a worker's main process beside the pool: the registry heartbeat that
    keeps this worker's capacity row fresh, and the reconciler service (on duty when it
    holds the deployment-wide duty; see ``orchestrator.services.reconciler``)."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        name: str,
        queues: list[str],
        concurrency: int,
        tasks: list[str] | None = None,
    ) -> None:
        self.orc, self.name, self.queues, self.concurrency = orchestrator, name, queues, concurrency
        #: the task names this worker registered (advertised, so that admission holds the others)
        self.tasks = tasks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="orc-registry", daemon=True)
        settings = orchestrator.settings
        self.reconciler: ReconcilerService | None = None
        if settings.worker_reconciler:
            self.reconciler = ReconcilerService(
                orchestrator.reconciler,
                name=name,
                interval=settings.tick_seconds,
                stall_seconds=settings.reconciler_stall_seconds,
            )

    def start(self) -> None:
        self.orc.register_worker(self.name, self.queues, self.concurrency, self.tasks)
        self._thread.start()
        if self.reconciler is not None:
            self.reconciler.start()

    def stop(self) -> None:
        self._stop.set()
        if self.reconciler is not None:
            self.reconciler.stop()
        try:
            self.orc.unregister_worker(self.name)
        except Exception:
            log.exception("could not unregister worker %s", self.name)

    def _loop(self) -> None:
        interval = max(min(5.0, self.orc.settings.worker_ttl / 3.0), 0.2)
        while not self._stop.wait(interval):
            try:
                self.orc.touch_worker(self.name, self.queues, self.concurrency, self.tasks)
            except Exception:
                log.exception("worker registry heartbeat failed")


_services: WorkerServices | None = None


def start_services(
    app: Celery, name: str, queues: list[str], concurrency: int, tasks: list[str] | None = None
) -> WorkerServices:
    """Register a worker's capacity (and the task names it registered, ``tasks``) and start its
    reconciler service until :func:`stop_services`."""
    global _services
    _services = WorkerServices(current_orchestrator(app), name, queues, concurrency, tasks)
    _services.start()
    return _services


def registered_names(app: Celery) -> list[str]:
    """The task names a DAG node may name that this worker's app registered: what the worker
    advertises (``orc_worker_tasks``)."""
    return sorted(n for n in app.tasks.keys() if not n.startswith(RESERVED_PREFIXES))


def stop_services() -> None:
    global _services
    if _services is not None:
        _services.stop()
        _services = None


@signals.worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not hasattr(app, "orchestrator_settings"):
        return
    queues = sorted(q.name for q in sender.task_consumer.queues)
    concurrency = int(getattr(sender.controller, "concurrency", None) or 1)
    start_services(app, sender.hostname, queues, concurrency, registered_names(app))


@signals.worker_shutdown.connect
def _on_worker_shutdown(**_: Any) -> None:
    stop_services()


@signals.worker_process_init.connect
def _on_pool_process_init(**_: Any) -> None:
    # a forked pool process must not use (or close) its parent's pooled connections
    for orc in all_orchestrators():
        orc.after_fork()
    if _services is not None and _services.reconciler is not None:
        _services.reconciler.forget_after_fork()
