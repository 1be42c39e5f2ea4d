"""The reconciler: the polling safety net that finds lost work from the database.

A pass (:meth:`Reconciler.run_pass`) releases due retries, re-publishes QUEUED tasks
unclaimed past the dispatch timeout, fails attempts whose lease deadline passed, wakes the waits
whose instant came and times out those whose deadline passed (``orc_wake_due_v2``), runs the
watchdog (a task no live worker can take, a message re-published ``ORCHESTRATOR_STUCK_REPUBLISHES``
times without a claim, a run with no transition for ``ORCHESTRATOR_STUCK_RUN_SECONDS``: flagged,
``needs_attention``, a ``task_stuck`` alert), deletes
events past their retention, finishes the event triggers' open firings, runs the child pass
(child runs of ``DAG.run_dag`` nodes started, their nodes ended with them, orphans cancelled by
policy: ``orchestrator.engine.children``), judges the run and
task deadlines that fell due (a miss is recorded once and alerted; a DAG with
``on_deadline="cancel"`` has its run cancelled), admits READY work into free capacity and
closes runs whose counter missed their end, then runs the flow pass (runs keyed flow control
holds released when their key frees: ``orchestrator.engine.flow``). Each item is
handled on its own: an error is logged and counted, and the pass goes on. Every action is a
compare-and-set, so two passes running at once still act once per item.

Where it runs (:class:`ReconcilerService`): a thread in the *main process* of every worker
(and ``orchestrator reconcile`` as a service), never a task in the workers' pool, so it
cannot wait in line behind user tasks. One service at a time is on duty across the
deployment: it holds a Postgres session-level advisory lock on a dedicated connection. When
the process on duty is killed its connection closes and the lock is free at once, so the
next service to tick takes the duty; when it is paused, the server ends its idle session
after ``reconciler_stall_seconds`` and the duty moves too.

The sharded mode (``ORCHESTRATOR_RECONCILER_SHARDS``, issue 35; ``docs/shards.md``): every
service reconciles at once, each the runs of the shards it claimed (``store.shards``), every
write for a run fenced by the shard epoch it read.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.config import Settings
from ..core.models import RECONCILER, Outcome
from ..core.publisher import Publisher
from ..store import Store
from ..store.shards import Fence, Shards
from .alerts import raise_alert

log = logging.getLogger(__name__)

ACTIONS = (
    "released",
    "republished",
    "leases_expired",
    "deadlines_missed",
    "deadline_cancels",
    "waits_woken",
    "events_pruned",
    "trigger_firings",
    "child_runs",
    "flow_released",
    "breaker_changes",
    "stuck_flagged",
    "dispatched",
    "runs_finalized",
    "errors",
)
#: most missed deadlines recorded (and alerted) per pass, of runs and of tasks each; the rest
#: wait for the next pass
DEADLINE_BATCH = 100
#: waits due woken per transaction, and transactions per pass (a burst of sleeps due at one
#: second is woken within one pass up to their product)
WAKE_BATCH = 1000
WAKE_ROUNDS = 20
#: seconds between two deletions of the events past their retention, per reconciler
PRUNE_EVERY = 60.0
#: seconds between two of the watchdog's reads of the whole READY backlog (tasks no live worker
#: of their queue registered) and of the idle runs, and two prunes of the task names of workers
#: no longer live; every pass clears flags and flags the tasks a worker dropped as unregistered
#: and the messages re-published without a claim (one transaction)
WATCH_EVERY = 10.0


class Reconciler:
    """One pass over the database; see the module docstring.

    ``after(outcome, run_id, key)`` is called after each lease expiry is committed (the
    engine publishes what it admitted and raises the DEAD_LETTER alert)."""

    def __init__(
        self,
        store: Store,
        publisher: Publisher,
        settings: Settings,
        *,
        after: Callable[[Outcome, str, str], None] | None = None,
        triggers: Callable[[], int] | None = None,
        children: Callable[[], int] | None = None,
        flow: Callable[[], int] | None = None,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.settings = settings
        self.after = after or (lambda outcome, run_id, key: self.publisher.publish(outcome.dispatches))
        #: finishes the event triggers' open firings (left by an emitter that died, or waiting for
        #: room under max_active_runs), so they never depend on a beat running; returns how many
        self.triggers = triggers
        #: the child pass (``orchestrator.engine.children``): starts the children of child-run
        #: nodes WAITING, ends those whose child ended, cancels orphans by policy; returns how many
        self.children = children
        #: the flow pass (``orchestrator.engine.flow``): releases the runs keyed flow control holds
        #: (a freed key, a throttle's slot, a debounce's quiet end); returns how many
        self.flow = flow
        #: when this reconciler next deletes the events past their retention (monotonic)
        self._next_prune = 0.0
        #: when this reconciler next reads the READY backlog and the idle runs (monotonic)
        self._next_watch = 0.0
        #: stale dispatches seen behind an idle slot, and when first (monotonic): re-published
        #: only when a later pass, half a tick on at least, sees them so again
        self._idle_seen: dict[tuple[str, str, int, Any], float] = {}

    def run_pass(self, fence: Fence | None = None) -> dict[str, int]:
        """One pass; returns how many items each action handled (``errors``: items that failed).

        ``fence`` (the sharded mode, :class:`ReconcilerService` with
        ``ORCHESTRATOR_RECONCILER_SHARDS``): the per-run actions (due retries, lost dispatches,
        expired leases, waits due, runs to close) act on the runs of the shards it holds, each
        write refused and recorded once the shard's epoch moved, and so are the deadlines that
        fell due; the passes that are not per run run on the holder of shard 0 only; the
        admission runs on every instance (a compare-and-set under its own lock, skipped when
        another holds it)."""
        report = dict.fromkeys(ACTIONS, 0)

        def guarded(what: str, fn: Callable[[], Any]) -> Any:
            try:
                return fn()
            except Exception:
                log.exception("reconcile: %s failed", what)
                report["errors"] += 1
                return None

        leader = fence is None or fence.leader
        self._recover(report, guarded, fence)
        if leader:
            self._chores(report, guarded)
        # one admission per pass, after everything above made its tasks READY; deadlines after
        # it, so a slow alert webhook never delays dispatch (slots a deadline's cancel frees
        # are admitted by the next pass)
        admitted = guarded("admitting ready tasks", lambda: self._admit(fence))
        if admitted:
            report["dispatched"] += self.publisher.publish(admitted)
        if leader and self.triggers is not None:
            report["trigger_firings"] = guarded("finishing event triggers' firings", self.triggers) or 0
        if leader and self.children is not None:
            report["child_runs"] = guarded("starting and ending child runs", self.children) or 0
        finalized = guarded("closing finished runs", lambda: self.store.recovery.finalize_runs(fence=fence))
        report["runs_finalized"] = finalized or 0
        if leader and self.flow is not None:  # after the close: a run finished now frees its key now
            report["flow_released"] = guarded("releasing held runs of concurrency keys", self.flow) or 0
        self._deadlines(report, guarded, fence)
        return report

    def _admit(self, fence: Fence | None) -> list[Any]:
        """The pass's admission (``wait=False``), in a transaction the server ends when it is
        left idle longer than the shards' lease (``fence``) or the duty's stall bound: the
        admission locks it took are held until its commit, so a process paused between the
        admission and its commit would otherwise hold those queues' locks (and every
        completion waiting on them) for as long as it stays paused. Ended, it rolls back: what
        it admitted is READY again, nothing was published."""
        s = self.settings
        bound = fence.lease if fence is not None and fence.lease > 0 else s.reconciler_stall_seconds
        ms = str(max(int(bound * 1000), 1000))

        def tx(conn: Connection) -> list[Any]:
            conn.execute(sa.select(sa.func.set_config("idle_in_transaction_session_timeout", ms, True)))
            return self.store.admission.admit(conn, s.dispatch_window, wait=False)

        return self.store.db.transaction(tx)

    def _recover(
        self, report: dict[str, int], guarded: Callable[[str, Callable[[], Any]], Any], fence: Fence | None
    ) -> None:
        """Due retries released, lost dispatches re-published, expired leases failed, waits due
        woken: of the runs of ``fence``'s shards (every run without one)."""
        s, recovery = self.settings, self.store.recovery
        report["released"] = guarded("releasing due retries", lambda: recovery.release_due_retries(fence)) or 0
        stale = guarded("finding lost dispatches", lambda: recovery.stale_queued(s.dispatch_timeout, fence=fence)) or []
        for run_id, key, attempt, version in self._confirmed(stale):
            d = guarded(
                f"re-publishing {run_id}.{key}",
                lambda: recovery.redispatch(run_id, key, attempt, version, fence),  # noqa: B023
            )
            if d is not None:
                report["republished"] += self.publisher.publish([d])
                flag = guarded(
                    f"counting the re-publishes of {run_id}.{key}",
                    lambda: recovery.flag_republished(run_id, key, attempt, s.stuck_republishes),  # noqa: B023
                )
                if flag is not None:
                    self._alert_stuck(report, guarded, [flag])
        for run_id, key, attempt in (
            guarded("finding expired leases", lambda: recovery.expired_leases(fence=fence)) or []
        ):
            outcome = guarded(
                f"expiring the lease of {run_id}.{key}",
                lambda: recovery.lose_lease(run_id, key, attempt, s.dispatch_window, fence),  # noqa: B023
            )
            if outcome is not None:
                report["leases_expired"] += int(outcome.accepted)
                guarded(f"publishing after {run_id}.{key}", lambda: self.after(outcome, run_id, key))  # noqa: B023
        for _ in range(WAKE_ROUNDS):
            woken = guarded("waking the waits due", lambda: self.store.waits.wake_due(WAKE_BATCH, fence)) or 0
            report["waits_woken"] += woken
            if woken < WAKE_BATCH:
                break

    def _chores(self, report: dict[str, int], guarded: Callable[[str, Callable[[], Any]], Any]) -> None:
        """What is not per run: events past their retention, interrupted cancels, the breakers,
        the watchdog."""
        s = self.settings
        if time.monotonic() >= self._next_prune:  # a delete of a few old rows: once a minute is enough
            self._next_prune = time.monotonic() + PRUNE_EVERY
            report["events_pruned"] = (
                guarded("pruning old events", lambda: self.store.waits.prune_events(s.event_retention_seconds)) or 0
            )
            self._finish_cancels(guarded)
        # the breakers: expired probe leases count as failures, open ones whose time is up become
        # half-open (before the admission, which hands out their probes); each state change alerted
        changed = guarded("passing over the breakers", self.store.breakers.reconcile) or []
        for event in changed:
            if event.from_state is None or event.from_state == event.to_state:
                continue  # an operator's setting, not a state change
            report["breaker_changes"] += 1
            webhook = self.settings.alert_webhook or None
            guarded(
                f"alerting breaker {event.name}",
                lambda: raise_alert(event.alert(), webhook=webhook, actor="reconciler"),  # noqa: B023
            )
        self._watch(report, guarded)

    def _finish_cancels(self, guarded: Callable[[str, Callable[[], Any]], Any]) -> None:
        """Cancels whose process died after the run's CANCELLED, before its tasks were all
        cancelled (``OperatorActions.interrupted_cancels``): finished here, as ``reconciler``."""
        operator = self.store.operator
        for run_id in guarded("finding interrupted cancels", operator.interrupted_cancels) or []:
            done = guarded(f"finishing the cancel of {run_id}", lambda: operator.cancel_run(run_id, RECONCILER))  # noqa: B023
            if done is not None and done.revoke:
                log.warning("reconcile: finished the interrupted cancel of run %s", run_id)
                guarded(f"revoking the attempts of {run_id}", lambda: self.publisher.revoke(done.revoke))  # noqa: B023

    def _watch(self, report: dict[str, int], guarded: Callable[[str, Callable[[], Any]], Any]) -> None:
        """The watchdog (``Recovery.watch``): flags cleared where the task moved on, new flags
        alerted once. The READY backlog and the idle runs are read every ``WATCH_EVERY`` seconds."""
        full = time.monotonic() >= self._next_watch
        if full:
            self._next_watch = time.monotonic() + WATCH_EVERY
            # the task names of workers no longer live go (admission holds what only they had)
            guarded("pruning the workers' task names", self.store.workers.prune)
        idle = self.settings.stuck_run_seconds if full else 0.0
        flags = guarded("watching for stuck tasks", lambda: self.store.recovery.watch(idle, scan_ready=full)) or []
        self._alert_stuck(report, guarded, flags)

    def _alert_stuck(
        self, report: dict[str, int], guarded: Callable[[str, Callable[[], Any]], Any], flags: list[Any]
    ) -> None:
        webhook = self.settings.alert_webhook or None
        for flag in flags:
            report["stuck_flagged"] += 1
            guarded(
                f"alerting the stuck task {flag.run_id}.{flag.key}",
                lambda: raise_alert(flag.alert(), webhook=webhook, actor="reconciler"),  # noqa: B023
            )

    def _confirmed(self, stale: list[Any]) -> list[tuple[str, str, int, Any]]:
        """The stale dispatches to re-publish now: those overtaken by a later message at once;
        those behind an idle slot once a pass at least half a tick after the first has seen
        them so (a slot between one task's end and its next claim looks idle for a moment)."""
        now, settle = time.monotonic(), self.settings.tick_seconds / 2
        seen, self._idle_seen = self._idle_seen, {}
        ready = []
        for item in stale:
            ident = (item.run_id, item.key, item.attempt, item.dispatched_at)
            first = seen.get(ident, now)
            if item.overtaken or now - first >= settle:
                ready.append(ident)
            else:
                self._idle_seen[ident] = first
        return ready

    def _deadlines(
        self, report: dict[str, int], guarded: Callable[[str, Callable[[], Any]], Any], fence: Fence | None = None
    ) -> None:
        """Judge the deadlines that fell due: those met are closed in bulk; each miss is
        recorded once (a compare-and-set with its ledger event) and then alerted. A run whose
        DAG says ``on_deadline="cancel"`` is cancelled first, through the operator's cancel
        path as ``reconciler`` (its attempts in flight are revoked; their slots go to the
        next pass's admission). With ``fence``: the deadlines of the runs of its shards, each
        miss recorded under the shard's epoch."""
        deadlines = self.store.deadlines
        guarded("closing deadlines met", lambda: deadlines.judge_met(fence=fence))
        due = guarded("finding missed deadlines", lambda: deadlines.due(DEADLINE_BATCH, fence)) or []
        for run_id in dict.fromkeys(d.run_id for d in due if d.cancels):
            cancelled = guarded(
                f"cancelling {run_id} on its deadline",
                lambda: self.store.operator.cancel_run(run_id, RECONCILER),  # noqa: B023
            )
            if cancelled is None:
                continue
            in_flight, conflict, already = cancelled
            if conflict is None and not already:
                report["deadline_cancels"] += 1
                log.warning("reconcile: run %s missed a deadline and was cancelled (on_deadline=cancel)", run_id)
            if in_flight:
                guarded(f"revoking the attempts of {run_id}", lambda: self.publisher.revoke(in_flight))  # noqa: B023
        for item in due:
            what = f"{item.run_id}.{item.key}" if item.key is not None else item.run_id
            miss = guarded(f"recording the missed deadline of {what}", lambda: deadlines.record(item, fence))  # noqa: B023
            if miss is None:
                continue
            report["deadlines_missed"] += 1
            webhook = self.settings.alert_webhook or None
            guarded(
                f"alerting the missed deadline of {what}",
                lambda: raise_alert(miss.alert(), webhook=webhook, actor="reconciler"),  # noqa: B023
            )


class ReconcilerService:
    """Runs reconciler passes every ``interval`` seconds while on duty (see the module docstring).

    ``name`` labels the duty connection (``application_name`` on Postgres), so an operator
    can see in ``pg_stat_activity`` which process is on duty; in the sharded mode it is the
    instance's name in ``orc_shards.owner`` and ``orc_reconcilers``.

    The sharded mode (``ORCHESTRATOR_RECONCILER_SHARDS`` > 0, issue 35): no duty lock; each step
    first takes this instance's turn on the shard table (``Shards.rebalance``: heartbeat, renew
    its shards, give back what is over ceil(K / live instances) or claim up to it), then runs a
    pass fenced by the epochs it read (``Reconciler.run_pass(fence)``). A killed instance's
    shards are claimed by the others once their lease (``ORCHESTRATOR_RECONCILER_SHARD_LEASE``)
    passed; a stopped one gives them back at once.
    """

    def __init__(self, reconciler: Reconciler, *, name: str, interval: float, stall_seconds: float) -> None:
        self.reconciler = reconciler
        self.store = reconciler.store
        self.name = name
        self.interval = interval
        self.stall_seconds = stall_seconds
        settings = reconciler.settings
        #: the sharded mode's shard count asked for (0: one reconciler on duty, the duty lock)
        self.wanted_shards = settings.reconciler_shards
        self.shard_lease = settings.reconciler_shard_lease
        self.shards: Shards | None = Shards(self.store.db) if self.wanted_shards > 0 else None
        #: what this instance read at its last turn (the sharded mode): its shards and epochs
        self.fence: Fence | None = None
        self._configured = False
        if self.shards is None:
            reconciler.store.db.check_duty()
        self._duty: Connection | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0

    @property
    def on_duty(self) -> bool:
        """On duty (holding the duty lock), or in the sharded mode holding at least one shard."""
        if self.shards is not None:
            return bool(self.fence and self.fence.epochs)
        return self._duty is not None

    def step(self) -> dict[str, int] | None:
        """Take or keep the duty, and run one pass if on duty; ``None`` when another has it.
        In the sharded mode: this instance's turn on the shard table, then a pass fenced by
        the epochs it read (a pass even without a shard: the admission)."""
        if self.shards is not None:
            return self._sharded_step(self.shards)
        if not self._hold_duty():
            return None
        report = self.reconciler.run_pass()
        self.passes += 1
        return report

    def _sharded_step(self, shards: Shards) -> dict[str, int]:
        if not self._configured:
            shards.configure(self.wanted_shards)
            self._configured = True
        held = self.fence.epochs if self.fence is not None else {}
        self.fence = shards.rebalance(self.name, held, self.shard_lease)
        report = self.reconciler.run_pass(self.fence)
        self.passes += 1
        return report

    def _hold_duty(self) -> bool:
        backend = self.store.db.backend
        if self._duty is not None:
            try:
                backend.touch_duty_session(self._duty)  # still ours; also resets the idle clock
                return True
            except sa.exc.DBAPIError:
                log.warning("reconciler %s lost its duty connection; trying to take the duty again", self.name)
                self._drop_duty()
        conn: Connection | None = None
        try:
            conn = self.store.db.duty_connection().execution_options(isolation_level="AUTOCOMMIT")
            backend.prepare_duty_session(conn, label=self.label, stall_seconds=self.stall_seconds)
            if backend.try_reconciler_lock(conn):
                self._duty = conn
                log.info("reconciler %s is on duty", self.name)
                return True
        except sa.exc.DBAPIError:
            log.exception("reconciler %s could not check the duty", self.name)
        if conn is not None:
            _discard(conn)
        return False

    @property
    def label(self) -> str:
        return f"orchestrator-reconciler:{self.name}"[:63]

    def _drop_duty(self) -> None:
        conn, self._duty = self._duty, None
        if conn is None:
            return
        _discard(conn)

    def forget_after_fork(self) -> None:
        """In a forked child: close this process's copy of the duty socket, so that the duty
        session ends when the parent dies even while the child lives on (the child never
        reconciles: the service's thread does not exist in it)."""
        conn, self._duty = self._duty, None
        if conn is None:
            return
        try:
            fileno = conn.connection.driver_connection.fileno()  # type: ignore[union-attr]
            os.close(fileno)
        except Exception:
            log.debug("closing the inherited duty socket failed", exc_info=True)

    def release(self) -> None:
        """Give up the duty (another service takes it at its next tick); in the sharded mode,
        this instance's shards and heartbeat row (the others claim the shards at once)."""
        if self.shards is not None:
            self.fence = None
            try:
                self.shards.leave(self.name)
            except Exception:
                log.debug("giving the shards back failed", exc_info=True)
            return
        conn, self._duty = self._duty, None
        if conn is None:
            return
        try:
            self.store.db.backend.release_reconciler_lock(conn)
        except Exception:
            log.debug("releasing the reconciler duty failed", exc_info=True)
        _discard(conn)

    def run(self, *, once: bool = False, echo: Callable[[dict[str, int]], None] | None = None) -> None:
        """Loop until :meth:`stop` (or one step with ``once``)."""
        try:
            while True:
                try:
                    report = self.step()
                    if report is not None and echo is not None:
                        echo(report)
                except Exception:
                    log.exception("reconciler %s: pass failed", self.name)
                if once or self._stop.wait(self.interval):
                    return
        finally:
            self.release()

    def start(self) -> None:
        """Run in a daemon thread of this process."""
        self._thread = threading.Thread(target=self.run, name="orc-reconciler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def _discard(conn: Connection) -> None:
    """Close a duty connection for good: it carries session settings the pool must not reuse."""
    try:
        conn.invalidate()
        conn.close()
    except Exception:
        log.debug("closing a reconciler connection failed", exc_info=True)
