"""What a task's body and a Celery configuration use (``current_context()``, the base Task and
Request classes, ``orchestrator.worker:OrchestratedTask``): a re-export of :mod:`orchestrator.runtime.worker`."""

from .runtime.worker import (
    LeaseLost,
    OrchestratedRequest,
    OrchestratedTask,
    RetryRequested,
    TaskContext,
    WorkerServices,
    current_context,
)

__all__ = [
    "LeaseLost",
    "OrchestratedRequest",
    "OrchestratedTask",
    "RetryRequested",
    "TaskContext",
    "WorkerServices",
    "current_context",
]
