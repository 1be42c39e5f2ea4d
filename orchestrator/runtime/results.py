"""Celery's ``AsyncResult(id).state`` / ``.info`` / ``.result`` for an orchestrated attempt's id
(``<run>.<key>.<attempt>``), answered from the database: the app's result backend
(``result_backend``) is :class:`OrchestratorBackend`.

It stores nothing (the orchestrator commits every outcome itself; the app ignores results) and,
for any other id, is Celery's disabled backend. Only reads are answered, through the process's
orchestrator's reads (a process bound to a tenant answers its own runs only; another's attempt is
``PENDING``): two to four primary-key queries per call (the task row, its progress or its
attempt's last ledger row). ``.get()`` and chords still need a real result backend.

============================ =======================================================
the task's row               Celery's state (``info`` / ``result``)
============================ =======================================================
PENDING, READY, QUEUED,      ``PENDING``
WAITING, MAPPED
RUNNING                      its last ``update_state`` state and meta, else ``STARTED``
RETRYING                     ``RETRY`` (the error)
SUCCEEDED                    ``SUCCESS`` (the result)
FAILED, UPSTREAM_FAILED,     ``FAILURE`` (the error, as an exception)
DEAD_LETTER
SKIPPED                      ``IGNORED``
CANCELLED                    ``REVOKED``
============================ =======================================================

An attempt the task has moved past answers the state its own ledger rows end in.
"""

from __future__ import annotations

from typing import Any

from celery import states
from celery.backends.base import DisabledBackend

from ..core.errors import RunNotFound, TaskNotFound
from ..core.protocol import parse_task_id
from .passing import rebuilt_error
from .process import current_orchestrator

#: the task's state -> Celery's
CELERY_STATES = {
    "PENDING": states.PENDING, "READY": states.PENDING, "QUEUED": states.PENDING, "WAITING": states.PENDING,
    "MAPPED": states.PENDING, "RUNNING": states.STARTED, "RETRYING": states.RETRY, "SUCCEEDED": states.SUCCESS,
    "FAILED": states.FAILURE, "UPSTREAM_FAILED": states.FAILURE, "DEAD_LETTER": states.FAILURE,
    "SKIPPED": states.IGNORED, "CANCELLED": states.REVOKED,
}  # fmt: skip


class OrchestratorBackend(DisabledBackend):  # type: ignore[misc]
    """Celery's disabled backend that answers an orchestrated attempt's state from the database."""

    def as_uri(self, *args: Any, **kwargs: Any) -> str:
        return "orchestrator://"

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        parsed = parse_task_id(task_id)
        if parsed is None:
            return self._is_disabled()  # type: ignore[no-any-return]
        run_id, key, attempt = parsed
        reads = current_orchestrator(self.app).reads  # scoped: a tenant's process sees its own runs
        try:
            view = reads.get_task(run_id, key)
        except (RunNotFound, TaskNotFound):
            return _meta(task_id, states.PENDING, None)
        state, result, error = view.state.value, view.result, view.error
        if attempt != view.attempt:  # an attempt the task moved past (or not reached yet)
            if attempt > view.attempt:
                return _meta(task_id, states.PENDING, None)
            state, error = reads.attempt_outcome(run_id, key, attempt)
            result = None
        status = CELERY_STATES.get(state, states.PENDING)
        if status == states.STARTED and attempt == view.attempt:
            said = reads.progress(run_id, [key]).get(key)
            if said is not None:
                return _meta(task_id, said.state, said.meta)
            return _meta(task_id, status, {"worker": view.worker})
        if status in (states.FAILURE, states.RETRY):
            exc, trace = rebuilt_error(error or state)
            return _meta(task_id, status, self.prepare_exception(exc), trace)
        return _meta(task_id, status, result if status == states.SUCCESS else None)


def _meta(task_id: str, status: str, result: Any, traceback: str | None = None) -> dict[str, Any]:
    return {"task_id": task_id, "status": status, "result": result, "traceback": traceback, "children": []}
