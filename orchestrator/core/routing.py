"""Which Celery queue a task goes to (pure code).

Shared queues are one per priority class (``orchestrator.high``, ``orchestrator.default``,
``orchestrator.low``). A tenant listed as dedicated gets its own queue per priority class
(``orchestrator.tenant.<tenant>.<priority>``) so that it can be served by its own workers.
An explicit node ``queue`` wins over both.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

QUEUE_PREFIX = "orchestrator"
#: where workers park a message that keeps killing its pool process (no worker consumes it)
PARKED_QUEUE = "orchestrator.parked"
#: the tenant of a run, schedule, event or limit that names none
DEFAULT_TENANT = "default"


class Priority(enum.StrEnum):
    HIGH = "high"
    DEFAULT = "default"
    LOW = "low"

    @property
    def rank(self) -> int:
        """Lower ranks are dispatched first."""
        return _RANKS[self]


_RANKS = {Priority.HIGH: 0, Priority.DEFAULT: 1, Priority.LOW: 2}


def route(
    tenant: str,
    priority: Priority,
    queue: str | None = None,
    dedicated_tenants: Iterable[str] = (),
) -> str:
    """Return the queue name for a task of ``tenant`` at ``priority``."""
    if queue:
        return queue
    if tenant in set(dedicated_tenants):
        return tenant_queues(tenant)[list(Priority).index(priority)]
    return f"{QUEUE_PREFIX}.{priority.value}"


def tenant_queues(tenant: str) -> list[str]:
    """A dedicated tenant's queues, one per priority class: ``orchestrator.tenant.<tenant>.<p>``."""
    return [f"{QUEUE_PREFIX}.tenant.{tenant}.{p.value}" for p in Priority]


def queue_tenant(queue: str) -> str | None:
    """The tenant whose dedicated queue ``queue`` is (``orchestrator.tenant.<tenant>.<priority>``),
    or ``None`` for any other queue."""
    prefix = f"{QUEUE_PREFIX}.tenant."
    if not queue.startswith(prefix):
        return None
    return queue[len(prefix) :].rsplit(".", 1)[0]


def default_queues(dedicated_tenants: Iterable[str] = ()) -> list[str]:
    """Every queue that :func:`route` can choose without an explicit node queue."""
    queues = [f"{QUEUE_PREFIX}.{p.value}" for p in Priority]
    for tenant in dedicated_tenants:
        queues.extend(tenant_queues(tenant))
    return queues
