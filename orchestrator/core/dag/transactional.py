"""What a ``transactional=True`` node may be: checked at authoring (pure: the forms it cannot take)
and at submit (against the deployment's lease).

A transactional attempt's body runs inside one database transaction that the worker holds from
the body's start until its success commits, so the node must hold a worker for its whole run and
end within its lease: a sensor, a wait, an approval or a child run (which wait as rows, holding
no worker) cannot be transactional (a map can: each child is a transactional task); its hard
time limit, or the deployment's
``ORCHESTRATOR_MAX_TIME_LIMIT`` when it sets none, must not exceed ``ORCHESTRATOR_LEASE_SECONDS``.
A coroutine body or a body that raises ``Defer`` is refused when it runs (the worker fails the
attempt without a retry, its writes rolled back)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..errors import TransactionalError

#: what refuses a transactional node's form, by the node's field that says it has that form
FORMS = (
    ("sensor", "a sensor (it waits between checks holding no worker)"),
    ("wait", "a wait or an approval (it holds no worker)"),
    ("child", "a child run (it waits holding no worker)"),
)


def check_form(node: Any, dag: str | None) -> None:
    """A transactional ``node`` of ``dag`` takes none of the forms :data:`FORMS` lists; raise
    :class:`TransactionalError` naming the node."""
    if not isinstance(node.transactional, bool):
        raise TransactionalError(f"transactional must be true or false, not {node.transactional!r}"[:200], dag=dag,
                                 node=node.key)  # fmt: skip
    if not node.transactional:
        return
    for field, what in FORMS:
        if getattr(node, field, None) is not None:
            raise TransactionalError(f"a transactional node cannot be {what}", dag=dag, node=node.key)


def check_limits(name: str, nodes: Iterable[Any], lease_seconds: float, max_time_limit: float) -> None:
    """At submit: each transactional node ends within the lease, its hard time limit (or
    ``max_time_limit`` when it sets none) at most ``lease_seconds``: a body still running past
    its lease would hold its transaction while another attempt runs."""
    for node in nodes:
        if not node.transactional:
            continue
        limit = node.time_limit if node.time_limit is not None else max_time_limit
        if limit > lease_seconds:
            given = "its time_limit" if node.time_limit is not None else "ORCHESTRATOR_MAX_TIME_LIMIT"
            raise TransactionalError(
                f"a transactional task must end within its lease: {given} ({limit:g}s) exceeds"
                f" ORCHESTRATOR_LEASE_SECONDS ({lease_seconds:g}s); set time_limit at most the lease",
                dag=name,
                node=node.key,
            )


def runtime_problem(is_coroutine: Callable[[], bool]) -> str | None:
    """Why a transactional body cannot run as this task (``None``: it can)."""
    if is_coroutine():
        return "TransactionalError: a coroutine body (async def) cannot be transactional"
    return None
