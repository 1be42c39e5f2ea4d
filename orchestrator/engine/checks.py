"""What a submit checks beyond the DAG itself, before anything is written: the queues a run may
use, the time limits the deployment allows, a logical date's format."""

from __future__ import annotations

import datetime as dt

from ..core.dag import DAG
from ..core.errors import ValidationError
from ..core.routing import queue_tenant


def iso_problem(value: str) -> str | None:
    """``None`` when ``value`` is an ISO-8601 date or date-time."""
    try:
        dt.datetime.fromisoformat(value)
    except ValueError:
        return f"{value!r} is not an ISO-8601 date or date-time"
    return None


def check_queues(dag: DAG) -> None:
    """No node names another tenant's dedicated queue."""
    for node in dag.nodes.values():
        owner = queue_tenant(node.queue) if node.queue else None
        if owner is not None and owner != dag.tenant:
            raise ValidationError(
                f"queue {node.queue!r} is tenant {owner!r}'s dedicated queue; a run of tenant"
                f" {dag.tenant!r} cannot use it",
                dag=dag.name,
                node=node.key,
            )


def check_time_limits(dag: DAG, most: float) -> None:
    """Every hard limit at most ``most`` (ORCHESTRATOR_MAX_TIME_LIMIT); a soft limit below the
    hard limit that will apply (the node's own, or that setting)."""
    for node in dag.nodes.values():
        if node.time_limit is not None and node.time_limit > most:
            raise ValidationError(
                f"time_limit {node.time_limit}s exceeds ORCHESTRATOR_MAX_TIME_LIMIT ({most}s)",
                dag=dag.name,
                node=node.key,
            )
        if node.soft_time_limit is not None and node.time_limit is None and node.soft_time_limit >= most:
            raise ValidationError(
                f"soft_time_limit {node.soft_time_limit}s must be below the hard limit that applies,"
                f" ORCHESTRATOR_MAX_TIME_LIMIT ({most}s): set a time_limit above it or lower it",
                dag=dag.name,
                node=node.key,
            )
