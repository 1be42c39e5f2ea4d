"""Plumbing shared by every store role: the engine, the Postgres specifics, transactions, ids."""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..core.errors import ConfigurationError, SchemaMissingError
from . import schema as s
from .backend import DEFAULT_POOL_SIZE, Backend, duty_engine, make_engine

log = logging.getLogger(__name__)
R = TypeVar("R")


#: the oldest PostgreSQL the server functions are written for (``server_version_num``)
MIN_SERVER_VERSION = 150000


def new_run_id() -> str:
    return uuid.uuid4().hex


class Database:
    """One Postgres database: its engine, its specifics (``backend``) and transactions."""

    def __init__(
        self,
        url_or_engine: str | Engine,
        *,
        id_factory: Callable[[], str] = new_run_id,
        retry_seconds: float = 0.0,
        pool_size: int = DEFAULT_POOL_SIZE,
        transaction_pooler: bool = False,
        direct_url: str = "",
    ) -> None:
        if isinstance(url_or_engine, str):
            self.engine = make_engine(url_or_engine, pool_size=pool_size, transaction_pooler=transaction_pooler)
        else:
            self.engine = url_or_engine
        #: connections the hot path keeps at most in this process (as many as the store's pool)
        self.pool_size = pool_size
        #: the URL goes through a transaction-mode pooler: no server-side prepared statements
        self.transaction_pooler = transaction_pooler
        self._direct_url = direct_url
        self._duty_engine: Engine | None = None
        self.backend = Backend()
        self.new_id = id_factory
        #: how long a transaction keeps retrying through a lost connection (an outage, a
        #: restart) before the error reaches the caller; at least ``attempts`` tries are made
        self.retry_seconds = retry_seconds

    def check_duty(self) -> None:
        """Raise :class:`ConfigurationError` when this database cannot hold the reconciler's
        duty (a transaction pooler and no direct URL)."""
        if self.transaction_pooler and not self._direct_url:
            raise ConfigurationError(
                "the reconciler's duty is a session advisory lock, which a transaction pooler cannot hold:"
                " set ORCHESTRATOR_DB_DIRECT_URL to a URL straight to Postgres"
                " (or run the reconciler without ORCHESTRATOR_DB_TRANSACTION_POOLER)"
            )

    def duty_connection(self) -> Connection:
        """A connection of its own (never one of the pool's) for the reconciler's duty lock, to
        ``direct_url`` when one is given; refused through a transaction pooler without one (a
        session advisory lock taken through it would stay on a server connection that others
        then use, and outlive its holder)."""
        if self._duty_engine is None:
            self.check_duty()
            self._duty_engine = duty_engine(self._direct_url or self.engine.url)
        return self._duty_engine.connect()

    def transaction(self, fn: Callable[[Connection], R], *, attempts: int = 5) -> R:
        """Run ``fn`` in one transaction, retried on deadlock, serialization failure or a lost
        connection: ``attempts`` times, and for as long as ``retry_seconds`` allows (backoff up
        to 1 s). ``fn`` must be safe to re-run: every write in it is a CAS, so a retry after an
        ambiguous commit is refused, never applied twice."""

        def once() -> R:
            with self.engine.begin() as conn:
                return fn(conn)

        return self.retrying(once, attempts=attempts)

    def read(self, fn: Callable[[Connection], R]) -> R:
        """Run the read-only ``fn`` on a connection, retried like :meth:`transaction` (a read
        rides out a database restart within ``retry_seconds``)."""

        def once() -> R:
            with self.engine.connect() as conn:
                return fn(conn)

        return self.retrying(once)

    def upsert(
        self, table: sa.Table, key: dict[str, Any], values: dict[str, Any], defaults: dict[str, Any] | None = None
    ) -> None:
        """Set ``values`` on the row of ``table`` whose primary key is ``key``, making it (with
        ``defaults`` for the columns ``values`` leaves out) if there is none."""

        def tx(conn: Connection) -> None:
            where = [table.c[k] == v for k, v in key.items()]
            if conn.execute(table.update().where(*where).values(**values)).rowcount == 0:
                conn.execute(table.insert().values({**(defaults or {}), **key, **values}))

        self.transaction(tx)

    @staticmethod
    def transient(exc: BaseException) -> bool:
        """Whether ``exc`` is a database error that a retry may get past (an outage, a restart,
        or no connection of the process's pool free within its timeout)."""
        return isinstance(exc, sa.exc.TimeoutError) or (isinstance(exc, sa.exc.DBAPIError) and retryable(exc))

    def retrying(self, once: Callable[[], R], *, attempts: int = 5) -> R:
        deadline = time.monotonic() + self.retry_seconds
        i = 0
        while True:
            try:
                return once()
            except sa.exc.DBAPIError as exc:
                i += 1
                if not retryable(exc) or (i >= attempts and time.monotonic() >= deadline):
                    raise
                log.warning("database unreachable or busy (%s); retrying", type(exc.orig).__name__)
                backoff_sleep(i)

    def create_schema(self) -> None:
        """Create the tables directly, without the server functions (a schema comparison);
        everything that runs tasks needs ``migrate.upgrade``."""
        s.metadata.create_all(self.engine)

    def check_schema(self) -> None:
        """Raise :class:`SchemaMissingError` when the tables do not exist, when the database is
        behind the newest migration this code knows (the code needs what it installs, e.g. the
        server functions it calls), or when the server is older than Postgres 15. A database
        ahead of this code (a newer release migrated it: a rolling upgrade) is accepted: a
        migration keeps the functions older releases call (``store/functions.py``)."""
        from . import migrate

        where = self.engine.url.render_as_string(hide_password=True)
        if not self.read(lambda conn: sa.inspect(conn).has_table(s.runs.name)):
            raise SchemaMissingError(f"the database {where} has no orchestrator schema: run `orchestrator db upgrade`")
        version = self.read(lambda conn: int(conn.execute(sa.text("SHOW server_version_num")).scalar_one()))
        if version < MIN_SERVER_VERSION:
            raise SchemaMissingError(
                f"the database {where} runs PostgreSQL {version // 10000}: the orchestrator needs 15 to 18"
            )
        at, head = self.retrying(lambda: migrate.current(self.engine)), migrate.head()
        if at != head and not migrate.is_ahead(at):
            raise SchemaMissingError(
                f"the database {where} is at schema revision {at}, this code needs {head}:"
                " run `orchestrator db upgrade`"
            )

    def dispose(self) -> None:
        self.engine.dispose()
        if self._duty_engine is not None:
            self._duty_engine.dispose()


def backoff_sleep(i: int) -> None:
    """Sleep before retry ``i`` (1, 2, ...): exponential from 20 ms, at most 1 s, with jitter."""
    time.sleep(min(0.01 * (2 ** min(i, 10)), 1.0) * (1 + random.random()))


#: SQLSTATEs worth a retry: deadlock, serialization failure, the server shutting down, starting
#: up or terminating the session, and connection failures
RETRYABLE_SQLSTATES = {"40P01", "40001", "57P01", "57P02", "57P03", "08000", "08001", "08003", "08004", "08006"}


def retryable(exc: sa.exc.DBAPIError) -> bool:
    """Deadlock, serialization failure, a terminated backend, a dropped or refused connection."""
    if exc.connection_invalidated:
        return True
    code = getattr(getattr(exc, "orig", None), "sqlstate", None)
    if code in RETRYABLE_SQLSTATES:
        return True
    if isinstance(exc, sa.exc.OperationalError) and code is None and exc.orig is not None:
        return type(exc.orig).__module__.startswith("psycopg")  # no session at all: connection refused
    return False
