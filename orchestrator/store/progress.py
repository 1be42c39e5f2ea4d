"""Each running attempt's latest progress (``orc_progress``): what a body reports with Celery's
``self.update_state(state=..., meta=...)`` or ``current_context().progress(...)``.

One row per task, overwritten by each report. A report is fenced by its attempt as every worker
write is: it is written only while the task's row holds that attempt RUNNING, so a stale
attempt (cleared, cancelled, taken over) cannot overwrite what the current one reports. Reads
show a task's progress only while its row holds the attempt that reported it. ``db clean``
removes a run's rows with the run, after writing them into its archive line (``"progress"``)."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from .database import Database

#: the fenced upsert: written only while the task holds the attempt RUNNING, and never over a
#: later attempt's row (a stale attempt's statement that raced a clear and the new claim)
_RECORD = sa.text(
    """
    INSERT INTO orc_progress (run_id, key, attempt, state, meta, updated_at)
    SELECT t.run_id, t.key, t.attempt, :state, CAST(:meta AS json), now()
    FROM orc_tasks t
    WHERE t.run_id = :run AND t.key = :key AND t.attempt = :attempt AND t.state = 'RUNNING'
    ON CONFLICT (run_id, key) DO UPDATE
    SET attempt = EXCLUDED.attempt, state = EXCLUDED.state, meta = EXCLUDED.meta, updated_at = EXCLUDED.updated_at
    WHERE orc_progress.attempt <= EXCLUDED.attempt
    """
)


class ProgressRows:
    def __init__(self, db: Database) -> None:
        self.db = db

    def record(self, run_id: str, key: str, attempt: int, state: str, meta: Any) -> bool:
        """Store ``attempt``'s latest progress (``meta``: plain JSON, already checked); ``False``
        when the task no longer holds that attempt RUNNING (nothing is written)."""
        params = {
            "run": run_id, "key": key, "attempt": attempt, "state": state,
            "meta": json.dumps(meta, separators=(",", ":")),
        }  # fmt: skip
        with self.db.engine.begin() as conn:
            return (conn.execute(_RECORD, params).rowcount or 0) == 1
