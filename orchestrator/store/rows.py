"""Rows become domain values (``models.py``) here and nowhere else."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.backoff import Backoff, Jitter
from ..core.models import Dispatch, EventView, RunView, TaskView
from ..core.states import RunState, TaskState
from . import schema as s
from .dbtime import aware

t_tasks = s.tasks

#: the columns a dispatch needs, returned by every transition that makes a message
DISPATCH_COLUMNS = (
    t_tasks.c.run_id, t_tasks.c.key, t_tasks.c.attempt, t_tasks.c.task_name, t_tasks.c.args, t_tasks.c.kwargs,
    t_tasks.c.queue, t_tasks.c.soft_time_limit, t_tasks.c.time_limit, t_tasks.c.priority_rank, t_tasks.c.ready_at,
)  # fmt: skip


def dispatch(r: Mapping[Any, Any]) -> Dispatch:
    """A dispatch from a row's mapping (``row._mapping``) or from the JSON a server function
    returns (``hotpath.py``): the same keys either way."""
    return Dispatch(
        r["run_id"], r["key"], r["attempt"], r["task_name"], list(r["args"]), dict(r["kwargs"]), r["queue"],
        r["soft_time_limit"], r["time_limit"], r.get("priority_rank", 1), bool(r.get("direct", False)),
    )  # fmt: skip


def backoff(raw: dict[str, Any]) -> Backoff:
    return Backoff(base=raw["base"], cap=raw["cap"], jitter=Jitter(raw["jitter"]))


def run_view(row: Any, counts: dict[str, int]) -> RunView:
    return RunView(
        id=row.id,
        dag=row.dag_name,
        tenant=row.tenant,
        state=RunState(row.state),
        priority=row.priority,
        idempotency_key=row.idempotency_key,
        params=row.params,
        task_count=row.task_count,
        open_tasks=row.open_tasks,
        created_at=aware(row.created_at),
        finished_at=aware(row.finished_at),
        counts=counts,
        logical_date=row.logical_date,
        schedule=row.schedule,
        dag_version=row.dag_version,
        rerun_of=row.rerun_of,
        trigger=row.trigger,
        stuck=getattr(row, "stuck", None),
        tags=dict(getattr(row, "tags", None) or {}),
        flow_key=getattr(row, "flow_key", None),
        held=getattr(row, "held", None),
        held_until=aware(getattr(row, "held_until", None)),
    )


def task_view(r: Any) -> TaskView:
    return TaskView(
        run_id=r.run_id,
        key=r.key,
        task=r.task_name,
        state=TaskState(r.state),
        attempt=r.attempt,
        max_attempts=r.max_attempts,
        trigger_rule=r.trigger_rule,
        queue=r.queue,
        priority=r.priority,
        args=r.args,
        kwargs=r.kwargs,
        result=r.result,
        error=r.error,
        fingerprint=r.fingerprint,
        worker=r.worker,
        dispatched_at=aware(r.dispatched_at),
        started_at=aware(r.started_at),
        finished_at=aware(r.finished_at),
        not_before=aware(r.not_before),
        ready_at=aware(r.ready_at),
        skip_reason=r.skip_reason,
        map_parent=r.map_parent,
        map_index=r.map_index,
        map_key=r.map_key,
        map_counts=(
            {
                "total": r.map_total,
                "done": r.map_done,
                "succeeded": r.map_ok,
                "failed": r.map_failed,
                "skipped": r.map_skipped,
            }
            if r.map_spec is not None and r.state in ("MAPPED", "SUCCEEDED", "FAILED", "SKIPPED")
            else None
        ),
        waiting=dict(r.waiting) if r.state == "WAITING" and getattr(r, "waiting", None) else None,
    )


def event_view(r: Any) -> EventView:
    return EventView(
        r.key, r.attempt, r.from_state, r.to_state, r.actor, r.reason, r.accepted, aware(r.at), r.by, r.kind
    )
