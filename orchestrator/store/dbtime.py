"""Time from the database: ``db_now()`` and ``db_after(seconds)`` as SQL expressions,
``now()`` and ``now() + make_interval(secs => s)``: leases, retries, deadlines and schedules
follow the database's clock, never a worker's.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement


class db_now(FunctionElement[dt.datetime]):  # noqa: N801 - reads like SQL
    type = sa.DateTime(timezone=True)
    inherit_cache = True


class db_after(FunctionElement[dt.datetime]):  # noqa: N801
    type = sa.DateTime(timezone=True)
    inherit_cache = True


@compiles(db_now)
def _now(element: Any, compiler: Any, **kw: Any) -> str:
    return "now()"


@compiles(db_after)
def _after(element: Any, compiler: Any, **kw: Any) -> str:
    return f"(now() + make_interval(secs => {compiler.process(element.clauses, **kw)}))"


def aware(value: dt.datetime | None) -> dt.datetime | None:
    """``value`` as an aware datetime, naive ones taken as UTC (``timestamptz`` columns come
    back aware; values built in Python or parsed from text may not be)."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value
