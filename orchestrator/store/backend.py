"""What is Postgres-specific in the store: how an engine is made, COPY for bulk inserts, and
the reconciler's duty lock (a session advisory lock). Postgres is the only backend; the hot
moves, settlement and admission are its server functions (``store/sql/``, ``functions.py``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..core.errors import ConfigurationError, ValidationError
from . import schema as s
from .dbtime import db_now

#: advisory lock key held by the one reconciler on duty
RECONCILER_LOCK = 0x6F7263_02


#: connections a process's store pool holds at most (``ORCHESTRATOR_DB_POOL_SIZE``)
DEFAULT_POOL_SIZE = 4


def make_engine(url: str, *, pool_size: int = DEFAULT_POOL_SIZE, transaction_pooler: bool = False) -> Engine:
    """An engine for ``url``: psycopg 3, with pre-ping, a pool of ``pool_size`` connections
    shared by the process's threads and as many again at a peak (a thread then waits for a free
    one), opened as needed. ``transaction_pooler``: the URL goes through PgBouncer in transaction mode, so
    psycopg never prepares a statement on the server (a later transaction may run on another
    server connection). ``embedded://DIR`` is the embedded server whose data directory is
    ``DIR`` (started when it is not running)."""
    if url.startswith("embedded:"):
        from . import embedded

        url = embedded.ensure(embedded.data_dir_of(url))
    url = psycopg_url(url)
    if not url.startswith("postgresql+psycopg://"):
        raise ConfigurationError(
            f"unsupported database URL {url.split(':', 1)[0]!r}: Postgres (15 to 18) is the only backend;"
            " give postgresql+psycopg://... or leave ORCHESTRATOR_DATABASE_URL unset for the embedded one"
        )
    engine = sa.create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,
        # as many again at a peak: a schedule's or a trigger's firing submits its run while it
        # holds the firing's row (two connections in one thread)
        max_overflow=pool_size,
        pool_timeout=60,
        connect_args=unprepared() if transaction_pooler else {},
    )
    sa.event.listen(engine, "handle_error", refuse_bad_values)
    return engine


def refuse_bad_values(context: sa.engine.ExceptionContext) -> None:
    """A value no column can hold (a NUL in a text, a lone surrogate, a number out of range) is
    the input's fault, on every path to the database: :class:`ValidationError` (the
    transaction rolls back: nothing written), never a raw driver error."""
    exc = context.original_exception
    if isinstance(exc, UnicodeEncodeError):
        raise ValidationError(f"a text holds a lone surrogate, which is not valid Unicode ({exc.reason})") from exc
    if isinstance(context.sqlalchemy_exception, sa.exc.DataError):
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValidationError(f"the database refused a value: {first}") from exc


def unprepared() -> dict[str, Any]:
    """psycopg's connect arguments for a connection through a transaction pooler."""
    return {"prepare_threshold": None}


def duty_engine(url: sa.engine.URL | str) -> Engine:
    """An engine without a pool, for the reconciler's duty: its session advisory lock lives on
    a connection of its own, held for as long as the duty, never one of the store's pool."""
    return sa.create_engine(psycopg_url(url) if isinstance(url, str) else url, poolclass=sa.pool.NullPool)


def psycopg_url(url: str) -> str:
    """``postgresql://`` rewritten to SQLAlchemy's psycopg 3 driver; any other URL as it is."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


class Backend:
    """Postgres: COPY, and the reconciler's duty as a session advisory lock."""

    name = "postgresql"

    def touch_duty_session(self, conn: Connection) -> None:
        """One round trip on the duty session: raises when the session is gone."""
        conn.execute(sa.text("SELECT 1"))

    def bulk_insert(self, conn: Connection, table: sa.Table, rows: Iterable[dict[str, Any]]) -> None:
        """COPY: a 10,000-node DAG in one stream, rows consumed as they are written."""
        stream = iter(rows)
        first = next(stream, None)
        if first is None:
            return
        columns = list(first)
        json_columns = {c for c in columns if isinstance(table.c[c].type, sa.JSON)}
        # shared values (empty args, a backoff) are encoded once; the memo holds each value too,
        # so that no id is reused by another object while the stream is written
        encoded: dict[int, tuple[Any, str]] = {}

        def encode(value: Any) -> str | None:
            if value is None:
                return None
            hit = encoded.get(id(value))
            if hit is None:
                hit = encoded[id(value)] = (value, json.dumps(value))
            return hit[1]

        dbapi = conn.connection.driver_connection
        assert dbapi is not None
        with dbapi.cursor() as cursor, cursor.copy(f"COPY {table.name} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in itertools.chain((first,), stream):
                copy.write_row([encode(row[c]) if c in json_columns else row[c] for c in columns])

    def try_reconciler_lock(self, conn: Connection) -> bool:
        return bool(conn.execute(sa.select(sa.func.pg_try_advisory_lock(RECONCILER_LOCK))).scalar_one())

    def release_reconciler_lock(self, conn: Connection) -> None:
        conn.execute(sa.select(sa.func.pg_advisory_unlock(RECONCILER_LOCK)))

    def reconciler_on_duty(self, conn: Connection) -> list[str]:
        # advisory locks are per database: the lock's low 32 bits are its objid
        return list(
            conn.execute(
                sa.text(
                    "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
                    " WHERE l.locktype = 'advisory' AND l.objid = :objid AND l.granted"
                    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                ),
                {"objid": RECONCILER_LOCK & 0xFFFFFFFF},
            ).scalars()
        )

    def prepare_duty_session(self, conn: Connection, *, label: str, stall_seconds: float) -> None:
        conn.execute(sa.text("SELECT set_config('application_name', :n, false)"), {"n": label})
        ms = max(int(stall_seconds * 1000), 1000)
        conn.execute(sa.text("SELECT set_config('idle_session_timeout', :ms, false)"), {"ms": str(ms)})


#: bulk insert of event rows stamped with the database's clock, without a round trip for it
EVENTS_AT_DB_NOW = s.events.insert().values(at=db_now())
