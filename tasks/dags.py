"""DAG factories for schedules: ``orchestrator schedule add NAME --every 300 --dag tasks.dags:daily_etl``.

A factory is called as ``factory(logical_date, params)`` each time its schedule fires, with the
scheduled instant (an aware UTC datetime) and the schedule's params, and returns the DAG to run.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from orchestrator import dag_factory
from orchestrator.cli.demo import build_demo_dag
from orchestrator.dag import DAG


@dag_factory
def daily_etl(logical_date: dt.datetime, params: dict[str, Any]) -> DAG:
    """The demo's ETL for the day of ``logical_date`` (in ``params["tz"]``, default UTC), for
    the tenant in ``params["tenant"]`` (default ``default``: a schedule's runs are its own
    tenant's, and a factory's DAG must not name another)."""
    from zoneinfo import ZoneInfo

    day = logical_date.astimezone(ZoneInfo(str(params.get("tz", "UTC")))).date().isoformat()
    return build_demo_dag(day, tenant=str(params.get("tenant", "default")))
