"""The engine: :class:`Orchestrator`, the facade every caller goes through."""

from .facade import (
    Orchestrator,
    RunHandle,
)

__all__ = [
    "Orchestrator",
    "RunHandle",
]
