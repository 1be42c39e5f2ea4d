"""The hot path on Postgres: the claim and the success in one round trip each.

The server functions ``orc_claim_v2``, ``orc_succeed_v2`` and ``orc_skip_v1`` (``store/sql/``; the
success and the skip settle and admit) are the only implementation of the claim, the success
and a body's skip. They are called on
a dedicated psycopg connection per process and thread, in autocommit (a single statement is
atomic: no BEGIN, no COMMIT), as prepared statements, without SQLAlchemy's per-call cost and
without a pool pre-ping. A dropped or refused connection is replaced and the call retried, with
backoff, for ``retry_seconds`` (the lease: a worker holding an outcome keeps trying to commit it
while its lease could still be valid): the call is a compare-and-set, so a retry after an
ambiguous commit is refused, never applied twice.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import psycopg
from psycopg.types.json import Json
from sqlalchemy.engine import Engine

from .database import backoff_sleep

log = logging.getLogger(__name__)

_CLAIM = "SELECT orc_claim_v2(%s::text, %s::text, %s::int, %s::text, %s::float8, %s::text)"
_SUCCEED = "SELECT orc_succeed_v2(%s::text, %s::text, %s::int, %s::json, %s::int, %s::float8, %s::int, %s::float8)"
_SKIP = "SELECT orc_skip_v1(%s::text, %s::text, %s::int, %s::text, %s::int, %s::float8, %s::int, %s::float8)"

#: connections a forked child inherited from its parent: kept referenced, never closed, so
#: that garbage collection in the child cannot end the parent's session
_inherited: list[Any] = []


class HotPath:
    def __init__(self, engine: Engine, *, attempts: int = 5, retry_seconds: float = 0.0) -> None:
        url = engine.url.set(drivername="postgresql")
        self.dsn = url.render_as_string(hide_password=False)
        self.attempts = attempts
        self.retry_seconds = retry_seconds
        self._local = threading.local()

    def _connection(self) -> psycopg.Connection[Any]:
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is not None and local.pid != os.getpid():
            _inherited.append(conn)
            conn = None
        if conn is None or conn.closed:
            conn = psycopg.connect(self.dsn, autocommit=True)
            local.conn, local.pid = conn, os.getpid()
        return conn

    def _call(self, query: str, params: tuple[Any, ...]) -> Any:
        deadline = time.monotonic() + self.retry_seconds
        i = 0
        while True:
            try:
                conn = self._connection()
                with conn.cursor() as cursor:
                    cursor.execute(query, params, prepare=True)
                    row = cursor.fetchone()
                    assert row is not None
                    return row[0]
            except (psycopg.OperationalError, psycopg.errors.DeadlockDetected) as exc:
                broken = getattr(self._local, "conn", None)
                if broken is not None and not broken.closed and not isinstance(exc, psycopg.errors.DeadlockDetected):
                    broken.close()
                i += 1
                if i >= self.attempts and time.monotonic() >= deadline:
                    raise
                log.warning("retrying %s after %s", query.split("(")[0], type(exc).__name__)
                backoff_sleep(i)

    def claim(
        self, run_id: str, key: str, attempt: int, worker: str, lease_seconds: float, task_name: str
    ) -> dict[str, Any]:
        """``{"claimed": true, "args", "kwargs", "wants_upstream", "upstream"}`` or
        ``{"claimed": false, "conflict"}``."""
        result: dict[str, Any] = self._call(_CLAIM, (run_id, key, attempt, worker, lease_seconds, task_name))
        return result

    def succeed(
        self,
        run_id: str,
        key: str,
        attempt: int,
        result: Any,
        window: int,
        worker_ttl: float,
        depth: int,
        aging: float,
    ) -> dict[str, Any]:
        """``{"accepted": true, "dispatches": [...]}``, ``{"accepted": false, "conflict"}`` or
        ``{"accepted": false, "invalid"}`` (a result its node cannot use; nothing written)."""
        params = (run_id, key, attempt, Json(result), window, worker_ttl, depth, aging)
        out: dict[str, Any] = self._call(_SUCCEED, params)
        return out

    def skip(
        self, run_id: str, key: str, attempt: int, reason: str, window: int, worker_ttl: float, depth: int, aging: float
    ) -> dict[str, Any]:
        """``{"accepted": true, "dispatches": [...]}`` or ``{"accepted": false, "conflict"}``."""
        out: dict[str, Any] = self._call(_SKIP, (run_id, key, attempt, reason, window, worker_ttl, depth, aging))
        return out

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid() and not conn.closed:
            conn.close()
        self._local.conn = None
