"""The one seam between Postgres and SQLite.

Everything that differs between the two backends is a method here: how an engine is made,
how a state change and its event rows become one statement, how many rows are inserted, how
children are matched by key, and the advisory locks that make admission and the reconciler's
duty one-at-a-time. No other store module asks which database it talks to.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .. import schema as s
from ..dbtime import db_now, register_sqlite_functions

#: advisory lock key serializing admission on Postgres (any constant unlikely to clash)
ADMISSION_LOCK = 0x6F7263_01
#: advisory lock key held by the one reconciler on duty
RECONCILER_LOCK = 0x6F7263_02

EVENT_COLUMNS = ("run_id", "key", "attempt", "from_state", "to_state", "actor", "by", "reason", "accepted", "at")


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

    def update_with_events(self, conn: Connection, update: sa.Update, event: dict[str, Any]) -> list[Any]:
        """Run ``update`` (which must return ``run_id``, ``key``, ``attempt``) and write one
        event per returned row with the constant columns of ``event`` (which may fix the
        ``attempt`` recorded, when the update changes it)."""
        rows = list(conn.execute(update).all())
        if rows:
            conn.execute(
                t_events_at_db_now(),
                [{"run_id": r.run_id, "key": r.key, "attempt": r.attempt, **event} for r in rows],
            )
        return rows

    def bulk_insert(self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]]) -> None:
        if rows:
            conn.execute(table.insert(), rows)

    def key_in(self, column: Any, keys: Sequence[str]) -> Any:
        """``column`` is one of ``keys``."""
        return column == keys[0] if len(keys) == 1 else column.in_(list(keys))

    def try_admission_lock(self, conn: Connection) -> bool:
        """Take the admission lock for this transaction without waiting; ``False`` if held."""
        return True

    def touch_duty_session(self, conn: Connection) -> None:
        """One round trip on the duty session: raises when the session is gone."""
        conn.execute(sa.text("SELECT 1"))

    def try_reconciler_lock(self, conn: Connection) -> bool:
        """Take the reconciler's duty on ``conn`` (held until released or the session ends)."""
        return True

    def release_reconciler_lock(self, conn: Connection) -> None:
        return None

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

    def update_with_events(self, conn: Connection, update: sa.Update, event: dict[str, Any]) -> list[Any]:
        # one statement: the UPDATE and its event rows (a data-modifying CTE)
        moved = update.cte("moved")
        constants: list[Any] = [
            sa.literal(event["from_state"], sa.String),
            sa.literal(event["to_state"], sa.String),
            sa.literal(event["actor"], sa.String),
            sa.literal(event["by"], sa.String),
            sa.literal(event["reason"], sa.Text),
            sa.literal(event["accepted"], sa.Boolean),
        ]
        attempt: Any = sa.literal(event["attempt"], sa.Integer) if "attempt" in event else moved.c.attempt
        insert = s.events.insert().from_select(
            list(EVENT_COLUMNS),
            sa.select(moved.c.run_id, moved.c.key, attempt, *constants, db_now()).select_from(moved),
        )
        return list(conn.execute(sa.select(*moved.c).add_cte(insert.cte("events"))).all())

    def bulk_insert(self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]]) -> None:
        """COPY: a 10,000-node DAG in one stream."""
        if not rows:
            return
        columns = list(rows[0])
        as_json = [isinstance(table.c[c].type, sa.JSON) for c in columns]
        dbapi = conn.connection.driver_connection
        assert dbapi is not None
        with dbapi.cursor() as cursor, cursor.copy(f"COPY {table.name} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(
                    [
                        json.dumps(row[c]) if j and row[c] is not None else row[c]
                        for c, j in zip(columns, as_json, strict=True)
                    ]
                )

    def key_in(self, column: Any, keys: Sequence[str]) -> Any:
        # a VALUES list joins on the primary key; a long IN list may be planned as a scan of the
        # whole run when the run is newer than the table statistics
        if len(keys) == 1:
            return column == keys[0]
        values = sa.values(sa.column("k", sa.String), name="keys").data([(k,) for k in keys])
        return column == values.c.k

    def try_admission_lock(self, conn: Connection) -> bool:
        return bool(conn.execute(sa.select(sa.func.pg_try_advisory_xact_lock(ADMISSION_LOCK))).scalar_one())

    def try_reconciler_lock(self, conn: Connection) -> bool:
        return bool(conn.execute(sa.select(sa.func.pg_try_advisory_lock(RECONCILER_LOCK))).scalar_one())

    def release_reconciler_lock(self, conn: Connection) -> None:
        conn.execute(sa.select(sa.func.pg_advisory_unlock(RECONCILER_LOCK)))

    def prepare_duty_session(self, conn: Connection, *, label: str, stall_seconds: float) -> None:
        conn.execute(sa.text("SELECT set_config('application_name', :n, false)"), {"n": label})
        ms = max(int(stall_seconds * 1000), 1000)
        conn.execute(sa.text("SELECT set_config('idle_session_timeout', :ms, false)"), {"ms": str(ms)})


def t_events_at_db_now() -> sa.Insert:
    """Bulk insert of event rows stamped with the database's clock, without a round trip for it."""
    return _EVENTS_AT_DB_NOW


_EVENTS_AT_DB_NOW = s.events.insert().values(at=db_now())
