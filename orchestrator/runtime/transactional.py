"""The worker's side of a transactional attempt (``dag.task(..., transactional=True)``): its
transaction opened after the claim (``store/transactional.py``), the body refused when it cannot
run in one (a coroutine body; a ``Defer``), and its success committed in that transaction with
the body's writes. Every other outcome rolls the writes back before it is recorded."""

from __future__ import annotations

import inspect
import logging
from typing import Any

from celery.exceptions import Ignore

from ..core.dag.transactional import runtime_problem
from ..core.models import Outcome
from ..core.protocol import FencingToken
from ..engine.facade import Orchestrator
from ..store.transactional import TaskTransaction

log = logging.getLogger(__name__)

#: a transactional body that raised ``Defer``: it would wait holding no worker, its transaction open
DEFER_REFUSED = (
    "TransactionalError: a transactional body cannot Defer (it waits holding no worker); its writes rolled back"
)


def open_for(orc: Orchestrator, task: Any, token: FencingToken) -> TaskTransaction:
    """The claimed attempt's transaction. A body that cannot run in one fails its attempt
    without a retry, and a transaction that cannot be opened fails it with one (the database
    unreachable): both raise :class:`Ignore` once the failure is recorded."""
    problem = runtime_problem(lambda: inspect.iscoroutinefunction(task.run))
    if problem is not None:
        orc.fail_attempt(token, error=problem, exc_types=["TransactionalError"], retryable=False)
        raise Ignore()
    try:
        return orc.begin_transaction(token)
    except Exception as exc:
        log.exception("could not open the transaction of %s", token.task_id)
        orc.fail_attempt(token, error=f"its transaction could not be opened: {type(exc).__name__}: {exc}"[:4000],
                         exc_types=[type(exc).__name__])  # fmt: skip
        raise Ignore() from None


def refuse_defer(orc: Orchestrator, token: FencingToken, txn: TaskTransaction) -> Outcome:
    """The body raised ``Defer``: its writes are rolled back (its connection given back) and its
    attempt fails, no retry."""
    txn.close()
    return orc.fail_attempt(token, error=DEFER_REFUSED, exc_types=["TransactionalError"], retryable=False)


def commit(orc: Orchestrator, token: FencingToken, txn: TaskTransaction, result: Any) -> Any:
    """The body returned ``result``: its success and its writes commit together, or (fenced) both
    roll back and the refusal is recorded; a fenced attempt's message is dropped (:class:`Ignore`).
    A transaction that fails under the commit (its session ended: the server's idle timeout
    after a pause, a restart) fails the attempt, fenced: refused if the success did commit."""
    try:
        outcome = orc.complete_in(txn, token, result)
    except Exception as exc:
        log.exception("the transaction of %s failed before its commit was confirmed", token.task_id)
        txn.rollback()
        error = f"its transaction failed at its commit ({type(exc).__name__}: {exc}); its writes rolled back"
        orc.fail_attempt(token, error=error[:4000], exc_types=[type(exc).__name__])
        raise Ignore() from None
    if not outcome.accepted:
        log.info("transactional attempt %s fenced: its writes rolled back (%s)", token.task_id, outcome.conflict)
        raise Ignore()
    return result
