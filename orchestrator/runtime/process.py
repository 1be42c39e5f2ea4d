"""One :class:`~orchestrator.engine.facade.Orchestrator` per (process, Celery app): what a worker's
main process and its pool processes use (engines and connections are never shared across a
fork; ``worker.py`` makes a forked pool process drop the ones it inherited)."""

from __future__ import annotations

import os
import threading
from typing import Any

from ..engine.facade import Orchestrator

_orchestrators: dict[tuple[int, int], Orchestrator] = {}
_orchestrators_lock = threading.Lock()


def current_orchestrator(app: Any) -> Orchestrator:
    """The orchestrator of ``app`` in this process, made on first use."""
    ident = (os.getpid(), id(app))
    orc = _orchestrators.get(ident)
    if orc is None:
        with _orchestrators_lock:
            orc = _orchestrators.get(ident)
            if orc is None:
                orc = Orchestrator(app=app)
                _orchestrators[ident] = orc
    return orc


def all_orchestrators() -> list[Orchestrator]:
    """Every orchestrator made in this process or inherited from its parent."""
    return list(_orchestrators.values())
