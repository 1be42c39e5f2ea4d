"""DAG factories the schedule tests name (``tests.factories:...``)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from orchestrator.dag import DAG


def probe(logical_date: dt.datetime, params: dict[str, Any]) -> DAG:
    """One no-op probe task; its name carries the params' ``name`` (default ``probe``)."""
    dag = DAG(str(params.get("name", "probe")))
    dag.task("only", "tasks.probes.noop")
    return dag


def broken(logical_date: dt.datetime, params: dict[str, Any]) -> DAG:
    raise RuntimeError(f"the warehouse is gone ({logical_date.isoformat()})")


def not_a_dag(logical_date: dt.datetime, params: dict[str, Any]) -> Any:
    return 42
