"""A transactional attempt's transaction (``dag.task(..., transactional=True)``): one connection
of the store's pool, one transaction, handed to the body as ``current_context().transaction``;
the success's compare-and-set (``orc_succeed_v2``) runs in it, so the body's writes and its
success commit together or not at all.

- **Accepted**: committed (the crash point ``before_transaction_commit`` lies between the
  compare-and-set and the commit: a process killed there leaves neither).
- **Refused** (the attempt was fenced: its lease lost, the task cleared or cancelled, a duplicate
  won): everything is rolled back, the body's writes with the refused event, and the refusal is
  written again after the rollback, alone, as a rejected ledger row (:meth:`Attempts.succeed_in`).
- **Anything else** (the body raised, a result the node cannot use, a ``Defer``): rolled back.

The transaction sets ``idle_in_transaction_session_timeout`` to the lease: a body paused with its
transaction open (a stopped or frozen process, its attempt taken over) has its session ended by
the server after one lease, so its locks do not outlive it for long.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..core.crashpoints import crash_point

log = logging.getLogger(__name__)

_SUCCEED_IN = sa.text(
    "SELECT orc_succeed_v2(:run, :key, :attempt, CAST(:result AS json), :window, :ttl, :depth, :aging)"
)
_IDLE_TIMEOUT = sa.text("SELECT set_config('idle_in_transaction_session_timeout', :ms, true)")


class TaskTransaction:
    """One transactional attempt's connection, in its transaction from :meth:`open` on."""

    def __init__(self, connection: Connection, run_id: str, key: str, attempt: int) -> None:
        self.connection = connection
        self.run_id, self.key, self.attempt = run_id, key, attempt
        #: committed or rolled back: nothing more is done on it
        self.ended = False

    @classmethod
    def open(cls, engine: Engine, run_id: str, key: str, attempt: int, idle_seconds: float) -> TaskTransaction:
        """A connection of ``engine``'s pool in a new transaction whose idle time is bounded."""
        conn = engine.connect()
        try:
            conn.begin()
            conn.execute(_IDLE_TIMEOUT, {"ms": str(max(int(idle_seconds * 1000), 1))})
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        return cls(conn, run_id, key, attempt)

    def succeed(self, result: Any, window: int, worker_ttl: float, depth: int, aging: float) -> dict[str, Any]:
        """The success's compare-and-set in this transaction, then the commit; a refused or invalid
        outcome rolls everything back. Returns what ``orc_succeed_v2`` returned."""
        params = {
            "run": self.run_id, "key": self.key, "attempt": self.attempt, "result": json.dumps(result),
            "window": window, "ttl": worker_ttl, "depth": depth, "aging": aging,
        }  # fmt: skip
        out: dict[str, Any] = self.connection.execute(_SUCCEED_IN, params).scalar_one()
        if not out["accepted"]:
            self.rollback()
            return out
        crash_point("before_transaction_commit")
        self.ended = True
        self.connection.commit()
        return out

    def rollback(self) -> None:
        """Roll back everything the body wrote (a connection that cannot is discarded: the server
        ends its transaction with its session)."""
        if self.ended:
            return
        self.ended = True
        try:
            self.connection.rollback()
        except Exception:
            log.warning("rollback of %s.%s attempt %s failed; its connection is discarded", self.run_id, self.key,
                        self.attempt, exc_info=True)  # fmt: skip
            self.connection.invalidate()

    def close(self) -> None:
        """Roll back what is not committed and give the connection back to the pool."""
        try:
            self.rollback()
        finally:
            self.connection.close()
