"""The hot path on Postgres: the claim and the success in one round trip each.

The server functions ``orc_claim_v2``, ``orc_succeed_v2``, ``orc_claim_succeed_v1`` (both at once,
for a direct message's short body) and ``orc_skip_v1`` (``store/sql/``; the success and the skip
settle and admit) are the only implementation of the claim, the success and a body's skip. They are called on
psycopg connections of a small pool per process (at most ``pool_size``, shared by its threads: a
thread waits for a free one), in autocommit (a single statement is atomic: no BEGIN, no COMMIT),
as prepared statements (not through a transaction pooler), without SQLAlchemy's per-call cost
and without a pool pre-ping. A dropped or refused connection is replaced and the call retried, with
backoff, for ``retry_seconds`` (the lease: a worker holding an outcome keeps trying to commit it
while its lease could still be valid): the call is a compare-and-set, so a retry after an
ambiguous commit is refused, never applied twice.

Group commit (``group_commit=True``, ``ORCHESTRATOR_GROUP_COMMIT``, on by default): the calls that the threads of
one process make while one of them is already in flight wait for it and then go together, in
one transaction sent as one pipeline (one round trip, one commit): the first caller to find no
call in flight leads, runs its own call alone, and hands the lead on to the first call queued
behind it, which runs everything queued so far. A call never waits for a timer, so a lone
thread (a prefork pool process) always runs alone, in autocommit, as without it. When a group's
transaction fails (a lock it waited for over 0.1 s, as when it and another process's group wait
for each other; a dropped connection; an error one of its calls raises), it is rolled back (or
its commit is in doubt) and each of its calls is made again on its own, with the retries above:
every call is a compare-and-set, so one whose group did commit is refused the second time, never
applied twice.
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

from .backend import DEFAULT_POOL_SIZE, unprepared
from .database import backoff_sleep

log = logging.getLogger(__name__)

_CLAIM = "SELECT orc_claim_v2(%s::text, %s::text, %s::int, %s::text, %s::float8, %s::text)"
_SUCCEED = "SELECT orc_succeed_v2(%s::text, %s::text, %s::int, %s::json, %s::int, %s::float8, %s::int, %s::float8)"
_CLAIM_SUCCEED = (
    "SELECT orc_claim_succeed_v1(%s::text, %s::text, %s::int, %s::text, %s::text, %s::float8, %s::json, %s::int,"
    " %s::float8, %s::int, %s::float8)"
)
_SKIP = "SELECT orc_skip_v1(%s::text, %s::text, %s::int, %s::text, %s::int, %s::float8, %s::int, %s::float8)"


class _Call:
    """One call of a group: its statement, and its result or error once its group ran."""

    __slots__ = ("done", "error", "lead", "params", "query", "result")

    def __init__(self, query: str, params: tuple[Any, ...]) -> None:
        self.query = query
        self.params = params
        self.result: Any = None
        self.error: BaseException | None = None
        #: handed the lead: run everything queued (this call included)
        self.lead = False
        self.done = threading.Event()

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


#: a group waits at most this long for a lock, then is rolled back and its calls made alone: a
#: group holds the locks of its first calls while it waits for its later ones' (a fan-in's
#: row, the admission lock taken after the rows), so two groups, or a group and a lone call,
#: can wait for each other; this ends that in 0.1 s where Postgres's deadlock check would wait
#: ``deadlock_timeout`` (1 s) first
_GROUP_LOCK_TIMEOUT = "SET LOCAL lock_timeout = '100ms'"

#: connections a forked child inherited from its parent: kept referenced, never closed, so
#: that garbage collection in the child cannot end the parent's session
_inherited: list[Any] = []


class HotPath:
    def __init__(
        self,
        engine: Engine,
        *,
        attempts: int = 5,
        retry_seconds: float = 0.0,
        pool_size: int = DEFAULT_POOL_SIZE,
        prepare: bool = True,
        group_commit: bool = False,
    ) -> None:
        url = engine.url.set(drivername="postgresql")
        self.dsn = url.render_as_string(hide_password=False)
        self.attempts = attempts
        self.retry_seconds = retry_seconds
        self.pool_size = pool_size
        #: prepared statements (off through a transaction pooler: a statement prepared on one
        #: server connection does not exist on the next)
        self.prepare = prepare
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._idle: list[psycopg.Connection[Any]] = []
        self._slots = threading.BoundedSemaphore(pool_size)
        #: group commit: calls waiting behind the one in flight, and whether one is
        self.group_commit = group_commit
        self._group_lock = threading.Lock()
        self._queued: list[_Call] = []
        self._leading = False
        #: groups committed together, the calls in them, and groups that failed (made alone)
        self.groups = self.grouped_calls = self.groups_failed = 0

    def _own(self) -> None:
        """In a forked child: leave the parent's connections alone and start an empty pool."""
        if self._pid == os.getpid():
            return
        with self._lock:
            if self._pid == os.getpid():
                return
            _inherited.extend(self._idle)
            self._idle = []
            self._slots = threading.BoundedSemaphore(self.pool_size)
            self._group_lock = threading.Lock()
            self._queued = []
            self._leading = False
            self._pid = os.getpid()

    def _checkout(self) -> tuple[psycopg.Connection[Any], threading.BoundedSemaphore]:
        """A connection of the pool: an idle one, or a new one while fewer than ``pool_size``
        are out; otherwise wait for one to come back."""
        self._own()
        slots = self._slots
        slots.acquire()
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        try:
            if conn is None or conn.closed:
                conn = psycopg.connect(self.dsn, autocommit=True, **({} if self.prepare else unprepared()))
        except BaseException:
            slots.release()
            raise
        return conn, slots

    def _checkin(self, conn: psycopg.Connection[Any], slots: threading.BoundedSemaphore, *, broken: bool) -> None:
        with self._lock:
            keep = not broken and slots is self._slots and not conn.closed
            if keep:
                self._idle.append(conn)
        if not keep and not conn.closed:
            conn.close()
        slots.release()

    def _call(self, query: str, params: tuple[Any, ...]) -> Any:
        if self.group_commit:
            return self._grouped(query, params)
        return self._alone(query, params)

    def _grouped(self, query: str, params: tuple[Any, ...]) -> Any:
        """Group commit: run alone when nothing is in flight, else wait for the lead and run
        with every call queued behind the one in flight."""
        self._own()
        me = _Call(query, params)
        with self._group_lock:
            if self._leading:
                self._queued.append(me)
                lead = False
            else:
                self._leading = lead = True
        if not lead:
            me.done.wait()
            if not me.lead:
                return me.outcome()
        group = [me]
        try:
            if me.lead:
                with self._group_lock:
                    group, self._queued = self._queued, []
            if len(group) == 1:
                me.result = self._alone(query, params)
            else:
                self._run_group(group)
        except BaseException as exc:
            for call in group:
                if call.result is None and call.error is None:
                    call.error = exc
            raise
        finally:
            for call in group:
                if call is not me:
                    call.done.set()
            with self._group_lock:
                if self._queued:
                    # the first call queued leads the next group (it stays in the queue)
                    self._queued[0].lead = True
                    self._queued[0].done.set()
                else:
                    self._leading = False
        return me.outcome()

    def _run_group(self, group: list[_Call]) -> None:
        """The group's calls in one transaction, one pipeline; if it fails, each alone."""
        try:
            conn, slots = self._checkout()
        except psycopg.OperationalError:
            conn = None
        if conn is not None:
            broken = False
            try:
                # BEGIN, the calls and COMMIT queued together: one round trip
                with conn.pipeline():
                    with conn.transaction():
                        conn.execute(_GROUP_LOCK_TIMEOUT)
                        cursors = [conn.execute(c.query, c.params, prepare=self.prepare) for c in group]
                rows = [cur.fetchone() for cur in cursors]
                for call, row in zip(group, rows, strict=True):
                    assert row is not None
                    call.result = row[0]
                with self._group_lock:
                    self.groups += 1
                    self.grouped_calls += len(group)
                return
            except psycopg.Error as exc:
                broken = conn.broken
                log.warning("a group of %d calls failed (%s): each is made alone", len(group), type(exc).__name__)
                with self._group_lock:
                    self.groups_failed += 1
            finally:
                self._checkin(conn, slots, broken=broken)
        for call in group:
            try:
                call.result = self._alone(call.query, call.params)
            except Exception as exc:  # noqa: BLE001 - raised to the call's own thread
                call.error = exc

    def _alone(self, query: str, params: tuple[Any, ...]) -> Any:
        deadline = time.monotonic() + self.retry_seconds
        i = 0
        while True:
            conn, slots = self._checkout_retrying(deadline, i)
            broken = False
            try:
                with conn.cursor() as cursor:
                    cursor.execute(query, params, prepare=self.prepare)
                    row = cursor.fetchone()
                    assert row is not None
                    return row[0]
            except (psycopg.OperationalError, psycopg.errors.DeadlockDetected) as exc:
                broken = not isinstance(exc, psycopg.errors.DeadlockDetected)
                i += 1
                if i >= self.attempts and time.monotonic() >= deadline:
                    raise
                log.warning("retrying %s after %s", query.split("(")[0], type(exc).__name__)
            finally:
                self._checkin(conn, slots, broken=broken)
            backoff_sleep(i)

    def _checkout_retrying(self, deadline: float, i: int) -> tuple[psycopg.Connection[Any], threading.BoundedSemaphore]:
        while True:
            try:
                return self._checkout()
            except psycopg.OperationalError as exc:
                i += 1
                if i >= self.attempts and time.monotonic() >= deadline:
                    raise
                log.warning("retrying a connection to the database after %s", type(exc).__name__)
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

    def claim_succeed(
        self,
        run_id: str,
        key: str,
        attempt: int,
        worker: str,
        task_name: str,
        elapsed: float,
        result: Any,
        window: int,
        worker_ttl: float,
        depth: int,
        aging: float,
    ) -> dict[str, Any]:
        """The claim and the success in one statement (a direct message's body that finished
        before its claim): what :meth:`succeed` returns."""
        params = (run_id, key, attempt, worker, task_name, elapsed, Json(result), window, worker_ttl, depth, aging)
        out: dict[str, Any] = self._call(_CLAIM_SUCCEED, params)
        return out

    def skip(
        self, run_id: str, key: str, attempt: int, reason: str, window: int, worker_ttl: float, depth: int, aging: float
    ) -> dict[str, Any]:
        """``{"accepted": true, "dispatches": [...]}`` or ``{"accepted": false, "conflict"}``."""
        out: dict[str, Any] = self._call(_SKIP, (run_id, key, attempt, reason, window, worker_ttl, depth, aging))
        return out

    def close(self) -> None:
        """Close this process's idle connections (those checked out close as they come back)."""
        if self._pid != os.getpid():
            return
        with self._lock:
            idle, self._idle = self._idle, []
            self._slots = threading.BoundedSemaphore(self.pool_size)
        for conn in idle:
            if not conn.closed:
                conn.close()
