"""Time from the database: ``db_now()`` and ``db_after(seconds)`` as SQL expressions.

On Postgres these are ``now()`` and ``now() + make_interval(secs => s)``. SQLite (the
embedded default, one machine) gets two registered functions that produce the same text
format SQLAlchemy stores, so comparisons stay correct.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

_SQLITE_FMT = "%Y-%m-%d %H:%M:%S.%f"


class db_now(FunctionElement[dt.datetime]):  # noqa: N801 - reads like SQL
    type = sa.DateTime(timezone=True)
    inherit_cache = True


class db_after(FunctionElement[dt.datetime]):  # noqa: N801
    type = sa.DateTime(timezone=True)
    inherit_cache = True


class aged_rank(FunctionElement[int]):  # noqa: N801
    """``priority_rank`` lowered by one class per ``aging`` seconds its task has been READY
    (``ready_at``), never below 0: ``aged_rank(rank, ready_at, aging)``."""

    type = sa.Integer()
    inherit_cache = True


@compiles(aged_rank)
def _aged_default(element: Any, compiler: Any, **kw: Any) -> str:
    rank, ready, aging = (compiler.process(c, **kw) for c in element.clauses)
    return (
        f"(CASE WHEN {aging} > 0 THEN greatest({rank} - floor(extract(epoch FROM now() - {ready}) / {aging})::int, 0)"
        f" ELSE {rank} END)"
    )


@compiles(aged_rank, "sqlite")
def _aged_sqlite(element: Any, compiler: Any, **kw: Any) -> str:
    rank, ready, aging = (compiler.process(c, **kw) for c in element.clauses)
    age = f"((julianday(orc_now()) - julianday({ready})) * 86400.0)"
    return f"(CASE WHEN {aging} > 0 THEN max({rank} - CAST({age} / {aging} AS INTEGER), 0) ELSE {rank} END)"


@compiles(db_now)
def _now_default(element: Any, compiler: Any, **kw: Any) -> str:
    return "now()"


@compiles(db_now, "sqlite")
def _now_sqlite(element: Any, compiler: Any, **kw: Any) -> str:
    return "orc_now()"


@compiles(db_after)
def _after_default(element: Any, compiler: Any, **kw: Any) -> str:
    return f"(now() + make_interval(secs => {compiler.process(element.clauses, **kw)}))"


@compiles(db_after, "sqlite")
def _after_sqlite(element: Any, compiler: Any, **kw: Any) -> str:
    return f"orc_now_plus({compiler.process(element.clauses, **kw)})"


def _sqlite_now() -> str:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None).strftime(_SQLITE_FMT)


def _sqlite_now_plus(seconds: float) -> str:
    moment = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=float(seconds or 0))
    return moment.replace(tzinfo=None).strftime(_SQLITE_FMT)


def register_sqlite_functions(dbapi_connection: Any) -> None:
    dbapi_connection.create_function("orc_now", 0, _sqlite_now)
    dbapi_connection.create_function("orc_now_plus", 1, _sqlite_now_plus)


def aware(value: dt.datetime | None) -> dt.datetime | None:
    """Datetimes from SQLite come back naive; they are UTC."""
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value
