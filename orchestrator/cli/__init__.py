"""The ``orchestrator`` command (``orchestrator.cli:main``)."""

from .app import (
    main,
)

__all__ = [
    "main",
]
