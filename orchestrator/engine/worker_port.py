"""The worker's port: the calls a worker (and the test kit's in-process worker) makes on the
orchestrator for each attempt it runs and for itself — claim, heartbeat, the outcomes, deferral,
its registration and the deliveries it counts. :class:`WorkerPort` is a base of
:class:`~orchestrator.engine.Orchestrator`: the calls stay on the orchestrator (``orc.claim(...)``)."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from ..core.config import Settings
from ..core.crashpoints import crash_point
from ..core.dag import check_json
from ..core.errors import ValidationError
from ..core.models import WORKER, Claim, Outcome
from ..core.protocol import FencingToken
from ..core.publisher import Publisher
from ..core.states import TaskState
from ..services.alerts import raise_alert
from ..store import Store
from ..store.reads import Reads
from ..store.reads.workers import WorkerView
from ..store.transactional import TaskTransaction


class _Engine(Protocol):
    """What the port needs of the orchestrator it is a base of."""

    settings: Settings
    publisher: Publisher

    @property
    def store(self) -> Store: ...

    @property
    def reads(self) -> Reads: ...

    def _after(self, outcome: Outcome, run_id: str, key: str) -> None: ...


class WorkerPort:
    """The worker's calls (see the module's docstring)."""

    def claim(self: _Engine, token: FencingToken, worker: str, task_name: str) -> Claim | None:
        """QUEUED -> RUNNING for the token's attempt of a task named ``task_name``, with a
        lease; ``None`` if refused."""
        return self.store.attempts.claim(
            token.run_id, token.key, token.attempt, worker, self.settings.lease_seconds, task_name
        )

    def heartbeat(self: _Engine, token: FencingToken) -> bool:
        """Extend the attempt's lease; ``False`` once the attempt no longer holds the task."""
        return self.store.attempts.heartbeat(token.run_id, token.key, token.attempt, self.settings.lease_seconds)

    def complete(
        self: _Engine, token: FencingToken, result: Any, *, claim: tuple[str, str, float] | None = None
    ) -> Outcome:
        """Commit the attempt's result (fenced), then publish what its children made ready.
        ``claim`` = ``(worker, task_name, elapsed seconds)``: a direct message's body that ran
        unclaimed, claimed in the same transaction."""
        outcome = self.store.attempts.succeed(
            token.run_id, token.key, token.attempt, result, self.settings.dispatch_window, claim=claim
        )
        crash_point("after_result_commit")
        self._after(outcome, token.run_id, token.key)
        return outcome

    def begin_transaction(self: _Engine, token: FencingToken) -> TaskTransaction:
        """The transaction a transactional attempt's body runs in (``current_context().transaction``),
        its idle time bounded by the lease."""
        return self.store.attempts.begin(token.run_id, token.key, token.attempt, self.settings.lease_seconds)

    def complete_in(self: _Engine, txn: TaskTransaction, token: FencingToken, result: Any) -> Outcome:
        """Commit a transactional attempt's result with its body's writes in ``txn`` (fenced: a
        refused compare-and-set rolls them back), then publish what its children made ready."""
        outcome = self.store.attempts.succeed_in(txn, result, self.settings.dispatch_window)
        crash_point("after_result_commit")
        self._after(outcome, token.run_id, token.key)
        return outcome

    def record_progress(self: _Engine, token: FencingToken, state: str, meta: Any) -> bool:
        """Store the attempt's latest progress (fenced: ``False`` and nothing written when the
        task no longer holds the attempt RUNNING). Raises :class:`ValidationError` for a state
        that is not 1-64 characters of text, or a ``meta`` that is not plain JSON within
        ``ORCHESTRATOR_MAX_PROGRESS_BYTES``."""
        check_progress(state, meta, self.settings.max_progress_bytes)
        return self.store.progress.record(token.run_id, token.key, token.attempt, state, meta)

    def skip_attempt(self: _Engine, token: FencingToken, reason: str) -> Outcome:
        """Commit the attempt as SKIPPED (fenced; the body raised :class:`orchestrator.Skip`),
        then publish what its children made ready."""
        outcome = self.store.attempts.skip(
            token.run_id, token.key, token.attempt, reason, self.settings.dispatch_window
        )
        self._after(outcome, token.run_id, token.key)
        return outcome

    def fail_attempt(
        self: _Engine,
        token: FencingToken,
        *,
        error: str,
        exc_types: Sequence[str] = (),
        fingerprint: str | None = None,
        retryable: bool = True,
    ) -> Outcome:
        """Commit a failed attempt (fenced): RETRYING, FAILED or DEAD_LETTER (see
        :meth:`orchestrator.store.attempts.Attempts.fail`), then publish and alert."""
        outcome = self.store.attempts.fail(
            token.run_id, token.key, token.attempt,
            error=error, window=self.settings.dispatch_window, exc_types=exc_types,
            fingerprint=fingerprint, retryable=retryable, actor=WORKER,
        )  # fmt: skip
        self._after(outcome, token.run_id, token.key)
        return outcome

    def defer_attempt(self: _Engine, token: FencingToken, spec: dict[str, Any]) -> bool:
        """RUNNING -> WAITING for the token's attempt (fenced): the body raised
        :class:`orchestrator.Defer`, or a sensor's check said "not yet" (``spec``: what
        ``orc_defer_v1`` takes). Its slot goes to other READY work at once. Returns whether the
        attempt still held the task (else the refusal is in the ledger)."""
        check_json(spec, "Defer")
        body = json.dumps(spec)
        if len(body) > self.settings.max_event_bytes:
            raise ValidationError(f"Defer: its state exceeds {self.settings.max_event_bytes} bytes of JSON")
        accepted, _, dispatches = self.store.waits.defer(
            token.run_id, token.key, token.attempt, body, self.settings.dispatch_window
        )
        self.publisher.publish(dispatches)
        return accepted

    def register_worker(
        self: _Engine,
        name: str,
        queues: Sequence[str],
        concurrency: int,
        tasks: Collection[str] | None = None,
        *,
        code_version: str | None = None,
    ) -> None:
        """Record a live worker's capacity on ``queues`` (every queue it consumes, its pinned
        ``Q@VERSION`` ones included), the task names it registered (``None``: it does not say, and
        takes every name) and the code version it advertises, and fill it with READY work."""
        self.store.workers.register(name, queues, concurrency, tasks, code_version=code_version)
        self.publisher.publish(self.store.admission.admit_ready(self.settings.dispatch_window))

    def touch_worker(
        self: _Engine,
        name: str,
        queues: Sequence[str],
        concurrency: int,
        tasks: Collection[str] | None = None,
        *,
        code_version: str | None = None,
    ) -> None:
        """Refresh a live worker's capacity row (re-registering it if it was dropped)."""
        if not self.store.workers.touch(name, code_version=code_version):
            self.store.workers.register(name, queues, concurrency, tasks, code_version=code_version)

    def drop_unregistered(self: _Engine, token: FencingToken, worker: str, task_name: str) -> bool:
        """``worker`` received the token's message without ``task_name`` registered: the task is
        held READY until a worker of its queue that has it registers (the watchdog flags it);
        returns whether the row still held that attempt QUEUED."""
        return self.store.workers.drop(self.store.ledger, token.run_id, token.key, token.attempt, worker, task_name)

    def unregister_worker(self: _Engine, name: str) -> None:
        """A worker is going away: its capacity no longer counts."""
        self.store.workers.unregister(name)

    def live_workers(self: _Engine) -> int:
        """How many workers are registered and alive."""
        return int(self.store.workers.live())

    def list_workers(self: _Engine) -> list[WorkerView]:
        """The live workers (seen within ``worker_ttl``), by name: their queues, code version, task
        names, concurrency and when they were last seen (``orchestrator workers``)."""
        return self.reads.workers(self.settings.worker_ttl)

    def count_delivery(self: _Engine, message_id: str, task_name: str) -> int:
        """Count one more delivery of a broker message; returns how many there were."""
        return int(self.store.deliveries.count(message_id, task_name))

    def park_delivery(self: _Engine, message_id: str, evidence: dict[str, Any]) -> None:
        """Record a message parked for too many deliveries, with the evidence."""
        self.store.deliveries.park(message_id, evidence)

    def _after(self: _Engine, outcome: Outcome, run_id: str, key: str) -> None:
        """After a committed outcome: publish what it admitted, alert if it parked the task."""
        self.publisher.publish(outcome.dispatches)
        if outcome.accepted and outcome.state is TaskState.DEAD_LETTER:
            task = self.store.reads.get_task(run_id, key)
            alert = {
                "run_id": run_id,
                "key": key,
                "task": task.task,
                "attempt": task.attempt,
                "error": task.error,
                "fingerprint": task.fingerprint,
            }
            raise_alert(alert, webhook=self.settings.alert_webhook or None, actor="orchestrator")


def check_progress(state: Any, meta: Any, max_bytes: int) -> None:
    """A progress report's ``state`` (1-64 characters of text) and ``meta`` (plain JSON of at
    most ``max_bytes``, ``ORCHESTRATOR_MAX_PROGRESS_BYTES``); raise :class:`ValidationError`."""
    if not isinstance(state, str) or not 0 < len(state) <= 64:
        raise ValidationError(f"progress state must be 1-64 characters of text, not {state!r}"[:200])
    check_json(meta, "progress meta")
    size = len(json.dumps(meta, separators=(",", ":")))
    if size > max_bytes:
        raise ValidationError(
            f"progress meta is {size} bytes of JSON, over ORCHESTRATOR_MAX_PROGRESS_BYTES={max_bytes}"
        )
