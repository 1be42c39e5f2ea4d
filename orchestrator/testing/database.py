"""The kit's database: one per pytest run (per xdist worker), migrated with the virtual clock
installed first, and emptied before each test.

Where it lives (:func:`resolve_url`):

- ``--orchestrator-db URL`` (or ``ORCHESTRATOR_KIT_DATABASE_URL``): exactly that database. It is
  wiped before every test: give one that holds nothing else.
- else, with ``ORCHESTRATOR_DATABASE_URL`` set to a Postgres URL: a database ``test_<name>`` on
  that server (made when missing), never the configured database itself (Django's rule: the
  tests wipe their database, a developer's data must not be in it).
- else an embedded PostgreSQL in a temporary directory, started for the session and stopped
  at its end (:class:`EmbeddedServer`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from ..core.config import Settings
from ..store import Store, embedded, make_engine, migrate
from ..store import schema as s
from ..store.backend import psycopg_url
from . import clock as clock_mod
from .clock import Clock

if TYPE_CHECKING:
    from ..engine.facade import Orchestrator

log = logging.getLogger(__name__)

#: an explicit database for the kit (wiped before every test)
KIT_URL_ENV = "ORCHESTRATOR_KIT_DATABASE_URL"
#: tables a test's clean state keeps: the deployment's signing key
KEPT = {s.secrets.name}


def worker_suffix() -> str:
    """``_gw0``, ... under pytest-xdist (each worker its own database), else empty."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return f"_{worker}" if worker else ""


def derived_url(configured: str) -> str:
    """The kit's database beside a configured one: ``test_<name>`` on the same server."""
    url = make_url(psycopg_url(configured))
    name = url.database or "orchestrator"
    return url.set(database=f"test_{name}{worker_suffix()}").render_as_string(hide_password=False)


class EmbeddedServer:
    """An embedded PostgreSQL of the kit's own, in a temporary directory: started on
    :meth:`start`, stopped (and its directory removed) on :meth:`stop`."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="orc-kit-"))
        self.pgdata = self.root / "pg"
        self.url: str | None = None

    def start(self) -> str:
        """Start the server; return the URL of the kit's database on it."""
        base = make_url(embedded.ensure(self.pgdata))
        self.url = base.set(database="orchestrator_test").render_as_string(hide_password=False)
        return self.url

    def stop(self) -> None:
        try:
            embedded.stop(self.pgdata)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def ensure_database(url: str) -> None:
    """Create the database of ``url`` on its server unless it exists."""
    target = make_url(url)
    admin = sa.create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with admin.connect() as conn:
            name = target.database
            if conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).first() is None:
                quoted = conn.dialect.identifier_preparer.quote(str(name))
                try:
                    conn.exec_driver_sql(f"CREATE DATABASE {quoted}")
                except sa.exc.ProgrammingError:  # made meanwhile by another process
                    pass
    finally:
        admin.dispose()


class KitDatabase:
    """The kit's database, ready to run DAGs: the clock installed, migrated to the newest
    schema (from scratch when it was migrated without the clock or is behind), and
    :meth:`clean` before each test. ``engine`` is shared by every test of the session."""

    def __init__(self, url: str) -> None:
        self.url = psycopg_url(url)
        self.engine: Engine = make_engine(self.url)
        self.clock = Clock(self.engine)
        self._store: Store | None = None
        self._heartbeater: Any = None

    @classmethod
    def prepare(cls, url: str) -> KitDatabase:
        url = psycopg_url(url)
        ensure_database(url)
        setup = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
        try:
            with setup.connect() as conn:
                clock_mod.install(conn, str(make_url(url).database))
        finally:
            setup.dispose()
        db = cls(url)  # sessions opened from here on have the clock's search path
        head = migrate.head()
        with db.engine.connect() as conn:
            marked = conn.execute(sa.text(f"SELECT migrated FROM {clock_mod.SCHEMA}.clock")).scalar()
        if marked != head or migrate.current(db.engine) != head:
            log.info("migrating the kit's database %s from scratch", make_url(url).database)
            migrate.reset(db.engine)
            with db.engine.begin() as conn:
                conn.execute(sa.text(f"UPDATE {clock_mod.SCHEMA}.clock SET migrated = :h"), {"h": head})
        db.check_clock()
        return db

    def check_clock(self) -> None:
        """Fail clearly when the database does not run on the clock (its search path)."""
        with self.engine.connect() as conn:
            path = conn.execute(sa.text("SHOW search_path")).scalar_one()
        if clock_mod.SCHEMA not in path:
            raise RuntimeError(f"the kit's database runs with search_path {path!r}, not the virtual clock's")

    def clean(self) -> None:
        """Delete every row (the signing key aside) and put the clock back at real time."""
        with self.engine.begin() as conn:
            for table in reversed(s.metadata.sorted_tables):
                if table.name not in KEPT:
                    conn.execute(table.delete())
            conn.exec_driver_sql(f"UPDATE {clock_mod.SCHEMA}.clock SET shift = interval '0'")

    def heartbeater(self, orc: Orchestrator) -> Any:
        """The worker heartbeater of every kit of the session (one thread, through the shared
        store), bound to the first kit's orchestrator."""
        if self._heartbeater is None:
            from ..runtime.heartbeat import Heartbeater

            self._heartbeater = Heartbeater(orc)
        return self._heartbeater

    def store(self, settings: Settings) -> Store:
        """The store of every test of the session (one engine, one hot path pool), built
        with the first kit's settings."""
        if self._store is None:
            self._store = Store(
                self.engine,
                poison_threshold=settings.poison_threshold,
                crash_loop_threshold=settings.crash_loop_threshold,
                worker_ttl=settings.worker_ttl,
                dispatch_depth=settings.dispatch_depth,
                priority_aging=settings.priority_aging_seconds,
                pool_size=settings.db_pool_size,
            )
        return self._store

    @property
    def display_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def dispose(self) -> None:
        if self._store is not None:
            self._store.dispose()
        self.engine.dispose()


def resolve_url(explicit: str | None = None) -> tuple[str | None, bool]:
    """(URL of the kit's database, or ``None`` for an embedded server; whether the URL was given
    exactly): see the module docstring."""
    given = explicit or os.environ.get(KIT_URL_ENV)
    if given:
        return given, True
    configured = os.environ.get("ORCHESTRATOR_DATABASE_URL", "")
    if configured and not configured.startswith(embedded.SCHEME):
        return derived_url(configured), False
    return None, False


__all__ = ["EmbeddedServer", "KitDatabase", "derived_url", "resolve_url"]
