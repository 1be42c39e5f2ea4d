"""Named crash points for fault tests: kill this process between two steps, on demand.

``ORCHESTRATOR_CRASH_AT`` names the point(s) (comma-separated). With ``ORCHESTRATOR_CRASH_MARKER``
set to a path, only the first process to reach a point dies (the marker file is created
atomically), so a restarted process runs on. Without the variables this is one dict lookup.
"""

from __future__ import annotations

import os
import signal

ENV, MARKER_ENV = "ORCHESTRATOR_CRASH_AT", "ORCHESTRATOR_CRASH_MARKER"

#: every crash point the code defines
POINTS = (
    "after_dispatch_commit",  # rows are QUEUED, the messages not yet published
    "after_claim_commit",  # the task is RUNNING, its body not started
    "after_result_commit",  # the outcome is committed, the message not yet acked
    "after_child_commit",  # a child run is stored and linked to its parent node, nothing published
    "before_transaction_commit",  # a transactional body's writes and its success written, not committed
)


def crash_point(name: str) -> None:
    """SIGKILL this process if ``name`` is armed (see module docstring)."""
    armed = os.environ.get(ENV)
    if not armed or name not in armed.split(","):
        return
    marker = os.environ.get(MARKER_ENV)
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)
