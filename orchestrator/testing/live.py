"""The live tier: a real Celery worker in a thread of the test's process, for the few tests that
want the broker and Celery's worker machinery in the loop (acks, the consumer's envelope checks,
the reconciler service's thread) on the kit's database.

Built on ``celery.contrib.testing.worker.start_worker`` without its ping check (its
``celery.ping`` task is registered by ``celery.contrib.testing.tasks`` only, the cause of
Celery #4851's ``NotRegistered``), with a solo pool, and with the orchestrator's services (the
worker's capacity row and the reconciler service) started as a worker's ``worker_ready`` would
(the test controller does not send it). Messages go through the app's broker; time is real
(the virtual clock still moves what the database calls now)."""

from __future__ import annotations

import os
from dataclasses import replace
from types import TracebackType
from typing import Any

from ..core.dag import DAG
from ..engine.facade import Orchestrator
from ..runtime import process
from .results import RunResult
from .runner import Kit


class LiveWorker:
    """A real worker of the kit's Celery app (``app``: default the kit's) in a thread; use as a
    context manager (the ``orchestrator_worker`` fixture does). ``run_dag`` submits through a
    Celery publisher and waits for the run in real time."""

    def __init__(self, kit: Kit, app: Any = None, *, tick: float = 0.1, shutdown_timeout: float = 30.0) -> None:
        self.kit = kit
        self.app = app if app is not None else kit.tasks.app
        settings = replace(kit.settings, tick_seconds=tick, worker_reconciler=True)
        self.orc = Orchestrator(settings, app=self.app, store=kit.db.store(settings))
        self.shutdown_timeout = shutdown_timeout
        self.worker: Any = None
        self._context: Any = None
        self._ident = (os.getpid(), id(self.app))
        self._was: Orchestrator | None = None

    @property
    def hostname(self) -> str:
        return str(self.worker.hostname) if self.worker is not None else ""

    def start(self) -> LiveWorker:
        from celery.contrib.testing.worker import start_worker

        from ..runtime.worker import start_services

        self._was = process._orchestrators.get(self._ident)
        process._orchestrators[self._ident] = self.orc
        self._context = start_worker(
            self.app,
            concurrency=1,
            pool="solo",
            perform_ping_check=False,
            shutdown_timeout=self.shutdown_timeout,
            loglevel="WARNING",
        )
        self.worker = self._context.__enter__()
        queues = sorted(self.app.amqp.queues.consume_from)
        start_services(self.app, self.hostname, queues, 1)
        return self

    def stop(self) -> None:
        from ..runtime.worker import stop_services

        try:
            stop_services()
        finally:
            try:
                if self._context is not None:
                    self._context.__exit__(None, None, None)
            finally:
                self._context = self.worker = None
                if self._was is None:
                    process._orchestrators.pop(self._ident, None)
                else:
                    process._orchestrators[self._ident] = self._was

    def __enter__(self) -> LiveWorker:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def run_dag(self, dag: DAG, *, timeout: float = 60.0, **submit: Any) -> RunResult:
        """Submit ``dag`` (its messages through the broker) and wait up to ``timeout`` seconds of
        real time for it to be final (:class:`~orchestrator.RunTimeout` otherwise)."""
        started = self.kit.clock.now()
        handle = self.orc.submit(dag, **submit)
        handle.wait(timeout, poll=0.05)
        return self.kit.result(handle.id, started_at=started)
