"""DAG factories the schedule tests name (``tests.factories:...``)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from orchestrator import dag_factory
from orchestrator.core.dag import DAG


@dag_factory
def probe(logical_date: dt.datetime, params: dict[str, Any]) -> DAG:
    """One no-op probe task; its name carries the params' ``name`` (default ``probe``)."""
    dag = DAG(str(params.get("name", "probe")))
    dag.task("only", "tasks.probes.noop")
    return dag


@dag_factory
def broken(logical_date: dt.datetime, params: dict[str, Any]) -> DAG:
    raise RuntimeError(f"the warehouse is gone ({logical_date.isoformat()})")


@dag_factory
def not_a_dag(logical_date: dt.datetime, params: dict[str, Any]) -> Any:
    return 42


def undeclared(logical_date: dt.datetime, params: dict[str, Any]) -> DAG:
    """Shaped like a factory but not declared one: a schedule naming it is refused."""
    return probe(logical_date, params)
