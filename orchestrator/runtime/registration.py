"""A worker's registration: the registry row that advertises its capacity, queues, task names and
code version (kept fresh by a heartbeat thread), the reconciler service beside it, and the worker
signals that start and stop them (connected on import: :mod:`orchestrator.runtime.worker` imports
this).

The code version (:func:`code_version`) is ``ORCHESTRATOR_CODE_VERSION``, else a hash of the
source files of the modules the worker's registered tasks are defined in. Once ``-Q`` is applied
(``celeryd_after_setup``), a worker of version V also consumes ``Q@V`` for each queue ``Q`` it
consumes, declared like the app's own queues; it registers those among its queues, so a run
pinned to V (``submit(..., code_version=V)``) reaches only workers of V that have its tasks."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path
from typing import Any

from celery import Celery, signals
from kombu.entity import Exchange, Queue

from ..core.registry import RESERVED_PREFIXES
from ..core.workers import modules_hash, pinned_queues
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
        code_version: str | None = None,
    ) -> None:
        self.orc, self.name, self.queues, self.concurrency = orchestrator, name, queues, concurrency
        #: the task names this worker registered (advertised, so that admission holds the others)
        self.tasks = tasks
        #: the code version it advertises (its pinned ``Q@VERSION`` queues are among ``queues``)
        self.code_version = code_version
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
        self.orc.register_worker(self.name, self.queues, self.concurrency, self.tasks, code_version=self.code_version)
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
                self.orc.touch_worker(
                    self.name, self.queues, self.concurrency, self.tasks, code_version=self.code_version
                )
            except Exception:
                log.exception("worker registry heartbeat failed")


_services: WorkerServices | None = None


def start_services(
    app: Celery,
    name: str,
    queues: list[str],
    concurrency: int,
    tasks: list[str] | None = None,
    code_version: str | None = None,
) -> WorkerServices:
    """Register a worker's capacity (and the task names it registered, ``tasks``, and the code
    version it advertises) and start its reconciler service until :func:`stop_services`."""
    global _services
    _services = WorkerServices(current_orchestrator(app), name, queues, concurrency, tasks, code_version)
    _services.start()
    return _services


def registered_names(app: Celery) -> list[str]:
    """The task names a DAG node may name that this worker's app registered: what the worker
    advertises (``orc_worker_tasks``)."""
    return sorted(n for n in app.tasks.keys() if not n.startswith(RESERVED_PREFIXES))


def task_sources(app: Celery) -> dict[str, bytes]:
    """The source of each module the app's registered tasks (:func:`registered_names`) are defined
    in: module name -> its file's bytes (empty for a module without a readable file)."""
    app.loader.import_default_modules()
    modules = {getattr(app.tasks[n], "run", app.tasks[n]).__module__ for n in registered_names(app)}
    out = {}
    for name in sorted(modules):
        path = getattr(sys.modules.get(name), "__file__", None)
        try:
            out[name] = Path(path).read_bytes() if path else b""
        except OSError:
            out[name] = b""
    return out


def code_version(app: Celery) -> str:
    """The code version a worker of ``app`` advertises: ``ORCHESTRATOR_CODE_VERSION`` (checked when
    the settings are read), else a hash of its task modules' sources (:func:`task_sources`)."""
    settings = getattr(app, "orchestrator_settings", None)
    if settings is not None and settings.code_version:
        return str(settings.code_version)
    return modules_hash(task_sources(app))


def add_pinned_queues(app: Celery, version: str) -> list[str]:
    """Consume ``Q@version`` besides each queue ``Q`` the worker consumes (after ``-Q``), declared
    like the app's own queues (a direct exchange of the queue's name); returns the queues added."""
    added = pinned_queues(list(app.amqp.queues.consume_from), version)
    for name in added:
        app.amqp.queues.select_add(Queue(name, Exchange(name, type="direct"), routing_key=name))
    return added


def stop_services() -> None:
    global _services
    if _services is not None:
        _services.stop()
        _services = None


@signals.celeryd_after_setup.connect
def _on_after_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    app = getattr(instance, "app", None)
    if app is None or not hasattr(app, "orchestrator_settings"):
        return
    version = code_version(app)
    app.orchestrator_code_version = version
    added = add_pinned_queues(app, version)
    log.info("worker %s: code version %s, pinned queues %s", sender, version, ", ".join(added) or "none")


@signals.worker_ready.connect
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or not hasattr(app, "orchestrator_settings"):
        return
    queues = sorted(q.name for q in sender.task_consumer.queues)
    concurrency = int(getattr(sender.controller, "concurrency", None) or 1)
    version = getattr(app, "orchestrator_code_version", None)
    start_services(app, sender.hostname, queues, concurrency, registered_names(app), version)


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
