"""The worker side: a base Celery Task that claims, heartbeats and commits fenced outcomes.

An orchestrated message carries (run, key, attempt) headers and their signature (an HMAC with
the deployment's key, ``protocol.sign``). The task:

0. verifies the signature for its own task name: a message that fails it (forged, or made for
   another task) is acked and dropped, and nothing is written;
1. claims with a CAS QUEUED -> RUNNING for that attempt (a lost claim: ack and drop);
2. runs the body with the arguments stored in the database, a heartbeat extending the lease;
   a direct message (its signed arguments are all the body gets; not redelivered) runs its
   body first, and is claimed with its success when the body ends within the claim delay
   (``ORCHESTRATOR_CLAIM_DELAY``), or from the heartbeat thread when the delay is up (a claim
   that loses stops the body);
3. commits SUCCEEDED (JSON result), SKIPPED (the body raised :class:`orchestrator.Skip`) or a
   failed attempt (RETRYING with backoff / FAILED), fenced by the attempt, settles the
   children and publishes what became dispatchable.

The same task called without those headers (``task.delay()``, ``task()``, Flower's apply) is a
plain Celery task that never touches a run. A hard time limit is recorded from the worker's
main process (:class:`OrchestratedRequest`) for a verified token only.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
import traceback
from types import SimpleNamespace
from typing import Any

from celery import Task, signals
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded, TimeLimitExceeded
from celery.worker.request import Request

from ..core.crashpoints import crash_point
from ..core.dag import MAP_MARK, UPSTREAM_KWARG, check_json
from ..core.dag.passing import placeholder
from ..core.errors import ResultNotSerializable, Skip, ValidationError
from ..core.models import Claim
from ..core.poison import exception_names, fingerprint, is_infrastructure
from ..core.protocol import (
    FENCING_HEADERS,
    HEADER_DIRECT,
    HEADER_SIGNATURE,
    FencingToken,
    MalformedHeaders,
    read_token,
    verify,
)
from ..core.waits import Defer, SensorSpec
from ..engine.facade import Orchestrator
from ..store.transactional import TaskTransaction
from . import transactional
from .aio import call_body, call_direct
from .context import TaskContext as TaskContext
from .context import _context
from .context import current_context as current_context
from .heartbeat import Heartbeater as Heartbeater
from .heartbeat import LeaseLost as LeaseLost
from .heartbeat import _heartbeater
from .inbox import count_drop
from .passing import mapped_kwargs, passed_args, wants_upstream_kwarg
from .process import current_orchestrator
from .progress import finish as finish_progress
from .progress import reporter_for
from .registration import WorkerServices as WorkerServices
from .registration import registered_names as registered_names
from .registration import start_services as start_services
from .registration import stop_services as stop_services

log = logging.getLogger(__name__)


class RetryRequested(Exception):
    """Raised by ``self.retry()`` inside an orchestrated task: a retryable failure whose
    delay comes from the node's backoff in the database, never a broker countdown."""


class OrchestratedTask(Task):  # type: ignore[misc]
    """Base class of every task of the project's app (``task_cls``)."""

    Request = "orchestrator.runtime.worker:OrchestratedRequest"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return call_direct(super().__call__(*args, **kwargs))
        token = verified_token(self, request, (args, kwargs))
        if token is None:
            # a plain Celery message: Task.__call__ would push a fresh request and hide this one
            return call_body(self, args, kwargs)
        # a redelivered message (its worker died, or it was restored unacknowledged) may be of an
        # attempt already claimed: it claims before its body, so a stale copy never runs
        direct = getattr(request, HEADER_DIRECT, None) is True and not _redelivered(request)
        return self._run_attempt(token, (list(args), dict(kwargs)) if direct else None)

    def update_state(self, task_id: str | None = None, state: str | None = None, meta: Any = None, **kw: Any) -> None:
        """Inside an orchestrated attempt (its own id): record its progress in the database
        (:meth:`TaskContext.progress`); anywhere else Celery's, through the result backend."""
        ctx = current_context()
        if ctx is not None and ctx.reporter is not None and task_id in (None, self.request.id):
            ctx.progress(meta, state=state or "PROGRESS")
            return
        super().update_state(task_id, state, meta, **kw)

    def retry(self, *args: Any, exc: BaseException | None = None, **kwargs: Any) -> Any:
        if current_context() is not None:
            raise RetryRequested(str(exc) if exc else "retry requested") from exc
        return super().retry(*args, exc=exc, **kwargs)

    def _run_attempt(self, token: FencingToken, direct: tuple[list[Any], dict[str, Any]] | None = None) -> Any:
        """Run one attempt. ``direct``: a direct message's verified arguments; with a claim
        delay the body starts unclaimed on them, and is claimed with its success when it
        finishes sooner (one transaction), or from the heartbeat thread when it does not."""
        orc = current_orchestrator(self.app)
        worker = f"{self.request.hostname or socket.gethostname()}:{os.getpid()}"
        hb = _heartbeater(orc)
        started = time.monotonic()
        args, kwargs, upstream, resumed, sensor, txn = self._begin(orc, hb, token, worker, direct)
        context = _context.set(
            TaskContext(
                token.run_id,
                token.key,
                token.attempt,
                upstream,
                orc.logical_date,
                resumed,
                reporter_for(orc, token),
                transaction=None if txn is None else txn.connection,
            )
        )
        status: str | None = None
        try:
            try:
                if MAP_MARK in kwargs:  # a map's transform, a kwargs_from item to spread
                    kwargs = mapped_kwargs(self.app, kwargs)
                result = call_body(self, args, kwargs)
            finally:
                finish_progress(orc, token)  # its last report, before its outcome
                status = hb.untrack(token)
            if status == "refused":
                raise Ignore()
            if status == "failed":
                raise _requeue()
        except Skip as exc:
            if txn is not None:
                txn.close()  # a skipped body leaves no writes
            if status == "lost":
                # the lease was lost meanwhile: this attempt no longer holds the task
                raise Ignore() from None
            _claim_late(orc, token, worker, self.name, status)
            orc.skip_attempt(token, exc.reason)
            return None
        except Defer as exc:
            if txn is not None:
                transactional.refuse_defer(orc, token, txn)  # rolled back and closed
                return None
            if status == "lost":
                raise Ignore() from None
            _claim_late(orc, token, worker, self.name, status)
            try:
                spec = exc.spec()
                check_json(spec, "Defer")
            except ValidationError as bad:
                orc.fail_attempt(token, error=f"Defer: {bad}", exc_types=["ValidationError"], retryable=False)
                return None
            orc.defer_attempt(token, spec)
            return None
        except (Ignore, Reject):
            raise
        except BaseException as exc:
            if txn is not None:
                txn.close()  # the body's writes rolled back before its failure is recorded
            if status is None:
                status = hb.untrack(token)
            _record_failure(orc, token, worker, self.name, status, exc)
            raise  # a terminated process goes on exiting
        finally:
            _context.reset(context)
        if txn is not None:
            try:
                return self._succeed(orc, token, worker, status, result, sensor, resumed, started, txn)
            finally:
                txn.close()
        return self._succeed(orc, token, worker, status, result, sensor, resumed, started)

    def _begin(
        self, orc: Orchestrator, hb: Heartbeater, token: FencingToken, worker: str,
        direct: tuple[list[Any], dict[str, Any]] | None,
    ) -> tuple[list[Any], dict[str, Any], dict[str, Any], Any, Any, TaskTransaction | None]:  # fmt: skip
        """The attempt's claim (or, for a direct body under a claim delay, its tracking while it
        runs unclaimed): ``(args, kwargs, upstream results, resumed state, sensor, transaction)``;
        the transaction is a transactional task's (never a direct message's), opened here."""
        if direct is not None and orc.settings.claim_delay > 0:
            hb.track_direct(token, lambda: orc.claim(token, worker, self.name) is not None)
            return direct[0], direct[1], {}, None, None, None
        claim = _claim_or_ignore(orc, token, worker, self.name)
        crash_point("after_claim_commit")
        kwargs = dict(claim.kwargs)
        upstream = claim.upstream_results
        if claim.wants_upstream and wants_upstream_kwarg(self):
            kwargs[UPSTREAM_KWARG] = upstream
        args = claim.args
        if placeholder(args) is not None:  # a parent's result passed as Celery passes it
            try:
                args = passed_args(orc, self, token.run_id, args, upstream)
            except Skip as exc:  # an error callback whose part did not fail itself
                orc.skip_attempt(token, exc.reason)
                raise Ignore() from None
        txn = transactional.open_for(orc, self, token) if claim.transactional else None
        hb.track(token)
        return args, kwargs, upstream, claim.resumed, claim.sensor, txn

    def _succeed(
        self, orc: Orchestrator, token: FencingToken, worker: str, status: str | None, result: Any, sensor: Any,
        resumed: Any, started: float, txn: TaskTransaction | None = None,
    ) -> Any:  # fmt: skip
        """The body returned: a sensor's "not yet" defers, a result the node cannot use fails the
        attempt, else the success is committed (with the claim, for a direct body still unclaimed)."""
        if sensor is not None and not result and status != "lost":
            # a sensor's check said "not yet": wait as a row until the next check
            orc.defer_attempt(token, sensor_defer(sensor, resumed))
            return None
        problem = _result_problem(result, orc.settings.max_result_bytes)
        if problem is not None:
            if txn is not None:
                txn.rollback()
            _claim_late(orc, token, worker, self.name, status)
            orc.fail_attempt(token, error=problem, retryable=False)
            raise ResultNotSerializable(f"task {self.name} ({token.task_id}): {problem}")
        if txn is not None:
            return transactional.commit(orc, token, txn, result)
        if status == "unclaimed":
            try:
                orc.complete(token, result, claim=(worker, self.name, time.monotonic() - started))
            except Exception:
                log.exception(_UNRECORDED, token.task_id)
                raise _requeue() from None
        else:
            orc.complete(token, result)
        return result


def _record_failure(
    orc: Orchestrator, token: FencingToken, worker: str, task_name: str, status: str | None, exc: BaseException
) -> None:
    """The body raised ``exc`` (``status``: the heartbeat's word on the attempt): record the
    attempt's failure (fenced), or drop or requeue the message when the attempt was never its
    own; raises :class:`Ignore` / :class:`Reject` for those, and returns when the caller re-raises
    ``exc`` (a terminated process goes on exiting)."""
    if status == "refused":
        # a direct body whose delayed claim lost: the claim's rejection is in the ledger
        count_drop("claim refused")
        raise Ignore() from None
    if status == "failed":
        raise _requeue() from None
    if status == "unclaimed" and not isinstance(exc, LeaseLost):
        try:
            _claim_late(orc, token, worker, task_name, status)
        except (Ignore, Reject):
            if _terminated_by(exc) is not None:
                raise exc from None  # a terminated process goes on exiting
            raise
    fp, evidence = fingerprint(exc)
    # a terminate signal (a revoke of a fenced attempt, or a shutdown) is a fence when the
    # attempt no longer holds the task, the lease check the heartbeat makes
    terminated = _terminated_by(exc)
    tracked = status in ("held", "unclaimed")
    fenced = isinstance(exc, LeaseLost) or not tracked or (terminated is not None and not _holds(orc, token))
    retryable = not isinstance(exc, (ResultNotSerializable, ValidationError, LeaseLost)) and not fenced
    if terminated is not None and fenced:
        error = f"LeaseLost: the attempt was fenced (cleared or cancelled); body terminated ({terminated})"
    elif terminated is not None:
        error = f"Terminated: body stopped by {terminated} (its worker is stopping)"
    elif fenced:
        error = "LeaseLost: the lease was taken over; body stopped"
    else:
        error = f"{_describe(exc)} [{evidence}]"
    orc.fail_attempt(
        token,
        error=error,
        exc_types=exception_names(exc),
        # an attempt taken over, a terminated body or an outage says nothing about the task's code
        fingerprint=None if fenced or terminated or is_infrastructure(exc) else fp,
        retryable=retryable,
    )
    if fenced and terminated is None:
        # the attempt was taken over; its rejected outcome is in the ledger
        raise Ignore() from None


def _redelivered(request: Any) -> bool:
    """Whether the broker flagged the message redelivered (RabbitMQ's flag; kombu's Redis
    transport sets it, and a header, on a message it restores)."""
    info = getattr(request, "delivery_info", None) or {}
    return bool(info.get("redelivered") or getattr(request, "redelivered", None))


def _claim_or_ignore(orc: Orchestrator, token: FencingToken, worker: str, task_name: str) -> Claim:
    """The claim before the body; a failed or refused claim acks and drops the message."""
    try:
        claim = orc.claim(token, worker, task_name)
    except Exception:
        log.exception("claim of %s failed; left to the reconciler", token.task_id)
        raise Ignore() from None
    if claim is None:
        # a duplicate, a stale attempt or an unknown task: counted here, in the ledger only
        # when the task exists (a rejected event)
        log.info("claim of %s refused; duplicate or stale message dropped", token.task_id)
        count_drop("claim refused")
        raise Ignore()
    return claim


def _claim_late(orc: Orchestrator, token: FencingToken, worker: str, task_name: str, status: str | None) -> None:
    """A direct body that finished unclaimed with another outcome than a success: claim now,
    before that outcome is recorded (a refused claim drops it; a claim that cannot be written
    requeues the message)."""
    if status != "unclaimed":
        return
    try:
        claim = orc.claim(token, worker, task_name)
    except Exception:
        log.exception(_UNRECORDED, token.task_id)
        raise _requeue() from None
    if claim is None:
        log.info("claim of %s refused; duplicate or stale message dropped", token.task_id)
        count_drop("claim refused")
        raise Ignore()


_UNRECORDED = "the claim of %s's direct body could not be written; its message goes back to its queue"


def _requeue() -> Reject:
    """A direct body ran, and its claim could not be written (the database unreachable past the
    retries, or the commit in doubt): its message goes back to its queue instead of being
    acknowledged, so the execution is not left without a record. It comes back flagged
    redelivered: the inbox counts the delivery (``orc_deliveries``, the record) and the
    attempt claims before its body runs again (a commit that did happen refuses that claim)."""
    return Reject(requeue=True)


class OrchestratedRequest(Request):  # type: ignore[misc]
    """The worker main process's request of an orchestrated task: when the pool kills the
    body at its hard time limit, the attempt's failure is recorded from here (the body never
    got to record it), for a verified fencing token only."""

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if soft:
            return
        headers = self._request_dict  # the message's headers (the main process has no task request)
        fencing = SimpleNamespace(id=self.id, **{h: headers.get(h) for h in FENCING_HEADERS})
        try:
            token = verified_token(self.task, fencing, (self.args, self.kwargs))
        except Ignore:
            return
        if token is None:
            return
        exc = TimeLimitExceeded(timeout)
        try:
            current_orchestrator(self.task.app).fail_attempt(
                token,
                error=f"TimeLimitExceeded: hard time limit ({exc})",
                exc_types=exception_names(exc),
                fingerprint=fingerprint(exc)[0],
            )
        except Exception:
            log.exception("could not record the hard time limit of %s", token.task_id)


def verified_token(task: Any, request: Any, arguments: tuple[Any, Any] | None = None) -> FencingToken | None:
    """The fencing token of an orchestrated request, once its signature verifies for
    ``task``'s name (and, for a direct message, for its ``arguments``); ``None`` for a plain
    Celery message (no fencing headers). A malformed or unverified token raises
    :class:`~celery.exceptions.Ignore` (the message is acked and dropped, nothing is written)
    after a log line, counted in ``inbox.DROPPED``."""
    try:
        token = read_token(request)
        direct = getattr(request, HEADER_DIRECT, None)
        if token is not None and direct not in (None, True):
            raise MalformedHeaders(f"malformed orchestrator direct header {direct!r}")
    except MalformedHeaders as exc:
        log.error("dropping message %s of %s: %s", request.id, task.name, exc)
        count_drop("fencing headers")
        raise Ignore() from None
    if token is None:
        return None
    key = current_orchestrator(task.app).signing_key
    signed = arguments if direct is True else None
    if (direct is True and arguments is None) or not verify(
        key, task.name, token, getattr(request, HEADER_SIGNATURE, None), signed
    ):
        log.error(
            "dropping message %s of %s: the fencing headers' signature does not verify (forged, or made"
            " for another task, other arguments or another deployment)",
            request.id,
            task.name,
        )
        count_drop("signature")
        raise Ignore()
    return token


def sensor_defer(row: dict[str, Any], resumed: dict[str, Any] | None) -> dict[str, Any]:
    """What a sensor's "not yet" waits for: its next check after the interval its count of
    checks gives, within the deadline fixed at its first check (carried across checks)."""
    spec = SensorSpec.from_row(row)
    state = (resumed or {}).get("state") or {}
    checks = int(state.get("checks", 0)) + 1
    out: dict[str, Any] = {
        "kind": "sensor", "delay": spec.interval(checks), "on_timeout": spec.on_timeout, "state": {"checks": checks},
    }  # fmt: skip
    deadline = (resumed or {}).get("deadline")
    if deadline is not None:
        out["deadline"] = deadline
    elif spec.timeout is not None:
        out["timeout"] = spec.timeout
    return out


def _holds(orc: Orchestrator, token: FencingToken) -> bool:
    """Whether the attempt still holds its task (the heartbeat's lease check); ``True`` when the
    database cannot say (its outcome's compare-and-set decides)."""
    try:
        return orc.heartbeat(token)
    except Exception:
        log.exception("lease check of %s failed", token.task_id)
        return True


def _terminated_by(exc: BaseException) -> str | None:
    """The signal that stopped the body, when ``exc`` is how it did: in a prefork pool process
    billiard's terminate handler raises ``SystemExit(signum - 256)`` (a revoke with
    ``terminate=True``, a cold shutdown); a ``KeyboardInterrupt`` is SIGINT's. ``None`` for
    anything else, a body's own ``sys.exit()`` included."""
    if isinstance(exc, KeyboardInterrupt):
        return "SIGINT"
    if not isinstance(exc, SystemExit) or not isinstance(exc.code, int) or not -256 < exc.code < 0:
        return None
    try:
        from billiard.common import terminate_handler_fired
    except ImportError:  # an older billiard: the exit code alone says it
        terminate_handler_fired = None
    if terminate_handler_fired is not None and not terminate_handler_fired():
        return None
    try:
        return signal.Signals(exc.code + 256).name
    except ValueError:
        return f"signal {exc.code + 256}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SoftTimeLimitExceeded):
        return "SoftTimeLimitExceeded: soft time limit exceeded"
    if isinstance(exc, TimeLimitExceeded):  # an async body's hard limit (threads, solo): as prefork's
        return f"TimeLimitExceeded: hard time limit ({exc})"
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text[:4000]


def _result_problem(result: Any, max_bytes: int) -> str | None:
    try:
        check_json(result, "result")
    except ValidationError as exc:
        return f"{exc}; tasks in a DAG must return plain JSON"
    size = len(json.dumps(result, separators=(",", ":")))
    if size > max_bytes:
        return f"result is {size} bytes of JSON, over ORCHESTRATOR_MAX_RESULT_BYTES={max_bytes}"
    return None


@signals.task_unknown.connect
def _on_task_unknown(sender: Any = None, message: Any = None, name: str | None = None, **_: Any) -> None:
    """The worker received a message of a task it has not registered (Celery logged "Received
    unregistered task" and dropped it). An orchestrated one, once its signature verifies for
    that name, holds its task READY (``WorkerRegistry.drop``) instead of leaving it QUEUED for the
    reconciler to re-publish every dispatch timeout."""
    app = getattr(sender, "app", None)
    if app is None or not hasattr(app, "orchestrator_settings") or message is None or not name:
        return
    try:
        headers = dict(message.headers or {})
        token = read_token(SimpleNamespace(**{h: headers.get(h) for h in FENCING_HEADERS}))
        if token is None:
            return
        orc = current_orchestrator(app)
        direct = headers.get(HEADER_DIRECT) is True
        signed = None
        if direct:
            body = message.payload
            signed = (list(body[0]), dict(body[1]))
        if not verify(orc.signing_key, name, token, headers.get(HEADER_SIGNATURE), signed):
            log.error("message %s of unregistered task %s: its signature does not verify; dropped", token.task_id, name)
            return
        worker = getattr(sender, "hostname", None) or socket.gethostname()
        if orc.drop_unregistered(token, worker, name):
            log.error(
                "task %s is not registered on worker %s: %s is held READY until a worker of its queue that has"
                " it registers",
                name,
                worker,
                token.task_id,
            )
    except Exception:
        log.exception("could not record the unregistered task %s", name)
