"""The one exception hierarchy of the orchestrator.

Every error a caller can see derives from :class:`OrchestratorError`. Errors raised
while validating input derive from :class:`ValidationError` and name the offending
DAG or node, so the CLI can print them as one line without a traceback.
"""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base class of every error raised by the orchestrator."""


class ConfigurationError(OrchestratorError):
    """A setting is missing or inconsistent; the message says what to set."""


class Skip(Exception):
    """Raise inside an orchestrated task to end it SKIPPED (not failed, never retried): its
    children then follow their trigger rules. ``reason`` is kept in the ledger."""

    def __init__(self, reason: str = "skipped by the task") -> None:
        super().__init__(reason)
        self.reason = str(reason)


class ValidationError(OrchestratorError):
    """Input was refused before anything was written or published.

    ``node`` names the offending node key when the problem belongs to one node.
    """

    def __init__(self, message: str, *, dag: str | None = None, node: str | None = None) -> None:
        self.dag = dag
        self.node = node
        where = []
        if dag is not None:
            where.append(f"DAG {dag!r}")
        if node is not None:
            where.append(f"node {node!r}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class CycleError(ValidationError):
    """The DAG has a cycle; ``cycle`` lists its node keys in order, first repeated last."""

    def __init__(self, cycle: list[str], *, dag: str | None = None) -> None:
        self.cycle = cycle
        super().__init__("cycle " + " -> ".join(cycle), dag=dag, node=cycle[0])


class UnknownTaskError(ValidationError):
    """A node names a task that is not registered in the Celery app."""


class UnknownLimitError(ValidationError):
    """A node names a pool or a rate limit that does not exist (``orchestrator pool set``,
    ``orchestrator limit set``)."""


class SpecError(ValidationError):
    """A DAG spec file (YAML/JSON) cannot be read or has the wrong shape."""


class TransactionalError(ValidationError):
    """A ``transactional=True`` node that would break what its transaction promises: a form that
    holds no worker while it waits (a sensor, a wait, a child run), a time limit above the
    lease, a coroutine body or one that raises ``Defer``."""


class IdempotencyConflict(ValidationError):
    """The idempotency key was already used, for the same DAG name and tenant, by a run of
    another DAG body or other ``params``; nothing was written. ``run_id`` is that run's id
    (submit the same DAG and params to get it back, or use another key)."""

    def __init__(self, message: str, *, run_id: str, idempotency_key: str, dag: str | None = None) -> None:
        self.run_id = run_id
        self.idempotency_key = idempotency_key
        super().__init__(message, dag=dag)


class TagError(ValidationError):
    """A run's tags (``submit(..., tags=)``) or a tag filter (``runs(tags=)``, ``--tag K=V``) was
    refused before anything was written; the message names the tag and what is wrong with it."""


class BulkFilterError(ValidationError):
    """A bulk action (``orc.bulk``, ``orchestrator bulk``) was refused before it touched a run:
    it had no filter at all (a tag, a state or a DAG), or its filter selects more runs than one
    bulk action may change (narrow it)."""


class EmitTimeout(ValidationError):
    """An emit's matching (its payload against the match of every wait and event trigger of its
    key, their wakes, the admission of what they made READY) ran past its statement bound
    (``ORCHESTRATOR_EMIT_TIMEOUT_SECONDS``); it was rolled back: nothing was written or woken.
    Emit it again, or make the waits on that key fewer or their matches smaller."""


class RunNotFound(OrchestratorError):
    """No run has the given id."""


class TaskNotFound(OrchestratorError):
    """The run has no task with the given key."""


class DagNotFound(OrchestratorError):
    """The registry has no DAG of that name for the tenant (``orchestrator dag register``), or
    not the version asked for (:class:`DagVersionNotFound`)."""


class DagVersionNotFound(DagNotFound):
    """The registered DAG has no such version."""


class SchemaMissingError(ConfigurationError):
    """The database has no orchestrator schema; run ``orchestrator db upgrade``."""


class RunTimeout(OrchestratorError):
    """``RunHandle.wait`` gave up before the run reached a final state."""


class ResultNotSerializable(OrchestratorError):
    """A task returned a value that is not plain JSON; the attempt fails without retry."""


class OperatorError(OrchestratorError):
    """An operator action does not apply to the task or run in its current state."""


class ConflictError(OperatorError):
    """A state change lost its compare-and-set: the task or run no longer holds the state
    (or attempt) the action expected. The refused write is in the ledger as a rejected event;
    re-read the state and decide again."""


class EventIdConflict(ConflictError):
    """An emit or a signal reused an ``event_id`` its tenant already emitted with another key,
    payload or target run; nothing was written and nothing woken (the same key, payload and
    target is an idempotent duplicate, answered ``duplicate``). ``event_id`` names the id, ``id``
    the first event's row. HTTP 409; CLI exit 2. Use a new id for a new event."""

    def __init__(self, message: str, *, event_id: str, id: int) -> None:
        self.event_id = event_id
        self.id = id
        super().__init__(message)
