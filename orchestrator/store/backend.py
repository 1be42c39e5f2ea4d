"""The one seam between Postgres and SQLite.

Everything that differs between the two backends is a method here: how an engine is made,
how many rows are inserted, whether the hot moves run as server functions (migration 0004, which
also holds admission's advisory lock), and the reconciler's duty lock. No other store module
asks which database it talks to.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .. import schema as s
from ..dbtime import db_now, register_sqlite_functions

#: advisory lock key held by the one reconciler on duty
RECONCILER_LOCK = 0x6F7263_02


def make_engine(url: str) -> Engine:
    """An engine for ``url``: psycopg 3 pool with pre-ping on Postgres, WAL SQLite otherwise."""
    if url.startswith("sqlite"):
        path = sa.engine.make_url(url).database
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        engine = sa.create_engine(url, connect_args={"timeout": 60, "check_same_thread": False}, pool_pre_ping=False)

        @sa.event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            register_sqlite_functions(dbapi_conn)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.close()

        @sa.event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # one writer at a time, taken up front: no lock upgrades, no SQLITE_BUSY deadlocks
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return sa.create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


def backend_for(engine: Engine) -> Backend:
    return PostgresBackend() if engine.dialect.name == "postgresql" else SqliteBackend()


class Backend:
    """What differs between databases. The base implementation is portable SQL."""

    name = "portable"
    #: whether one reconciler is on duty at a time (an advisory lock); without it, every
    #: reconciler service acts (the embedded default: one machine, passes are CAS-safe anyway)
    duty_lock = False
    #: whether the hot moves, settlement and admission run as server functions (migration 0004)
    server_functions = False

    def bulk_insert(self, conn: Connection, table: sa.Table, rows: Iterable[dict[str, Any]]) -> None:
        """Insert ``rows`` (consumed once, in chunks: never all in memory at once)."""
        stream = iter(rows)
        while chunk := list(itertools.islice(stream, 1000)):
            conn.execute(table.insert(), chunk)

    def touch_duty_session(self, conn: Connection) -> None:
        """One round trip on the duty session: raises when the session is gone."""
        conn.execute(sa.text("SELECT 1"))

    def try_reconciler_lock(self, conn: Connection) -> bool:
        """Take the reconciler's duty on ``conn`` (held until released or the session ends)."""
        return True

    def release_reconciler_lock(self, conn: Connection) -> None:
        return None

    def reconciler_on_duty(self, conn: Connection) -> list[str]:
        """Labels of the sessions holding the reconciler duty in this database (none without a lock)."""
        return []

    def prepare_duty_session(self, conn: Connection, *, label: str, stall_seconds: float) -> None:
        """Label the reconciler's duty session, and arrange that the server ends it when it
        stays silent for ``stall_seconds`` (a paused process), releasing its locks."""
        return None


class SqliteBackend(Backend):
    """The embedded default: one machine, one writer at a time (``BEGIN IMMEDIATE``)."""

    name = "sqlite"


class PostgresBackend(Backend):
    name = "postgresql"
    duty_lock = True
    server_functions = True

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
