"""Task and run states, the transition table and trigger rules (pure code).

The tables :data:`TRANSITIONS` (tasks) and :data:`RUN_TRANSITIONS` (runs) are the only
definition of which state changes are legal; the store's one transition writer
(``store/ledger.py``) checks every change against them.
"""

from __future__ import annotations

import enum

from .errors import OrchestratorError


class TaskState(enum.StrEnum):
    PENDING = "PENDING"
    READY = "READY"
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    RETRYING = "RETRYING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    UPSTREAM_FAILED = "UPSTREAM_FAILED"
    SKIPPED = "SKIPPED"
    CANCELLED = "CANCELLED"
    DEAD_LETTER = "DEAD_LETTER"
    #: a mapped node whose children run (it never runs itself); it closes after the last child
    MAPPED = "MAPPED"
    #: waiting for an event, an instant, an approval or its sensor's next check (``dag.wait``,
    #: ``dag.sensor``, ``raise orchestrator.Defer``): a row with an absolute deadline; it holds
    #: no worker slot, no broker message and no pool or limit slot
    WAITING = "WAITING"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


class RunState(enum.StrEnum):
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self is not RunState.RUNNING


TERMINAL = frozenset(
    {
        TaskState.SUCCEEDED,
        TaskState.FAILED,
        TaskState.UPSTREAM_FAILED,
        TaskState.SKIPPED,
        TaskState.CANCELLED,
    }
)

T = TaskState
NON_TERMINAL = frozenset(s for s in TaskState if s not in TERMINAL)

#: (from, to) -> who may make the change. ``None`` as source means "created".
TRANSITIONS: dict[tuple[TaskState, TaskState], frozenset[str]] = {
    (T.PENDING, T.READY): frozenset({"worker", "submit", "reconciler", "operator"}),
    # "submit": a map over an empty literal list ends at submit, and its downstream with it
    (T.PENDING, T.UPSTREAM_FAILED): frozenset({"worker", "submit", "reconciler", "operator"}),
    (T.PENDING, T.SKIPPED): frozenset({"worker", "submit", "reconciler", "operator"}),
    # a mapped node: expanded when its rule says READY (by whoever settled its last parent, or
    # at submit), then closed after its last child (SUCCEEDED / FAILED / SKIPPED: a summary)
    (T.PENDING, T.MAPPED): frozenset({"worker", "submit", "reconciler", "operator"}),
    (T.PENDING, T.FAILED): frozenset({"worker", "submit", "reconciler", "operator"}),
    (T.MAPPED, T.SUCCEEDED): frozenset({"worker", "reconciler", "operator"}),
    (T.MAPPED, T.FAILED): frozenset({"worker", "reconciler", "operator"}),
    (T.MAPPED, T.SKIPPED): frozenset({"worker", "reconciler", "operator"}),
    # an operator's retry of a map's FAILED child reopens the map; a clear of a closed map's
    # child (or of the map without what it maps over) reopens it whatever it closed as
    (T.FAILED, T.MAPPED): frozenset({"operator"}),
    (T.SUCCEEDED, T.MAPPED): frozenset({"operator"}),
    (T.SKIPPED, T.MAPPED): frozenset({"operator"}),
    (T.READY, T.QUEUED): frozenset({"dispatcher"}),
    (T.QUEUED, T.QUEUED): frozenset({"reconciler"}),
    (T.QUEUED, T.RUNNING): frozenset({"worker"}),
    # a worker received the message without the task registered (Celery's task_unknown): held
    # READY until a worker that has it registers (store/workers.py)
    (T.QUEUED, T.READY): frozenset({"worker"}),
    (T.RUNNING, T.SUCCEEDED): frozenset({"worker"}),
    # the body raised orchestrator.Skip
    (T.RUNNING, T.SKIPPED): frozenset({"worker"}),
    (T.RUNNING, T.RETRYING): frozenset({"worker", "reconciler"}),
    (T.RUNNING, T.FAILED): frozenset({"worker", "reconciler"}),
    (T.RUNNING, T.DEAD_LETTER): frozenset({"worker", "reconciler"}),
    (T.RETRYING, T.READY): frozenset({"reconciler"}),
    (T.DEAD_LETTER, T.READY): frozenset({"operator"}),
    (T.FAILED, T.READY): frozenset({"operator"}),
    (T.DEAD_LETTER, T.FAILED): frozenset({"operator"}),
    (T.DEAD_LETTER, T.SKIPPED): frozenset({"operator"}),
    # waits (store/sql/wait.sql): a wait node begins waiting when its rule says READY (settled by
    # whoever finished its last parent, or at submit); a body that raised Defer, or a sensor whose
    # check said "not yet", gives its slot back
    (T.PENDING, T.WAITING): frozenset({"worker", "submit", "reconciler", "operator", "event"}),
    (T.RUNNING, T.WAITING): frozenset({"worker"}),
    # woken: a wait node ends with its event's payload (or None); a deferred body is called again
    (T.WAITING, T.SUCCEEDED): frozenset({"event", "reconciler", "operator"}),
    # ("worker": a body that defers on an event that had already come is READY again at once)
    (T.WAITING, T.READY): frozenset({"event", "reconciler", "operator", "worker"}),
    # its deadline passed (WaitTimeout, or on_timeout="skip"); an approval rejected
    (T.WAITING, T.FAILED): frozenset({"reconciler", "operator"}),
    (T.WAITING, T.SKIPPED): frozenset({"reconciler", "operator"}),
    # a child-run node whose child FAILED or was CANCELLED, with attempts left: its next attempt
    # waits for a new child (store/children.py)
    (T.WAITING, T.WAITING): frozenset({"reconciler"}),
    # a wait that begins after its event (the lookback) or past its instant ends at once
    (T.PENDING, T.SUCCEEDED): frozenset({"worker", "submit", "reconciler", "operator", "event"}),
}
# an event or a signal that woke a wait settles it: what follows (children decided, a map's
# header closed) is the event's doing, as a worker's outcome's is the worker's
for (_src, _dst), _who in list(TRANSITIONS.items()):
    if _src in (T.PENDING, T.MAPPED) and "worker" in _who:
        TRANSITIONS[(_src, _dst)] = _who | {"event"}
# an operator's clear (any state back to PENDING, attempt + 1, to be run again) and mark (an
# outcome set by hand); a clear or mark decides tasks again from PENDING (orc_redecide_v2)
for _s in TaskState:
    TRANSITIONS.setdefault((_s, T.PENDING), frozenset())
    TRANSITIONS[(_s, T.PENDING)] = TRANSITIONS[(_s, T.PENDING)] | {"operator"}
    for _to in (T.SUCCEEDED, T.FAILED, T.SKIPPED):
        TRANSITIONS[(_s, _to)] = TRANSITIONS.get((_s, _to), frozenset()) | {"operator"}
# a cancel: an operator's, or the reconciler's for a run whose DAG says ``on_deadline="cancel"``
# and whose deadline (or a task's) passed before it was done (``store/deadlines.py``)
for _s in NON_TERMINAL:
    TRANSITIONS[(_s, T.CANCELLED)] = frozenset({"operator", "reconciler", "submit"})


class IllegalTransition(OrchestratorError):
    """A state change that the transition table does not allow."""


def check_transition(src: TaskState, dst: TaskState, actor: str) -> None:
    """Raise :class:`IllegalTransition` unless ``actor`` may move a task from ``src`` to ``dst``."""
    allowed = TRANSITIONS.get((src, dst))
    if allowed is None or actor not in allowed:
        raise IllegalTransition(f"{actor} may not move a task from {src.value} to {dst.value}")


#: run (from, to) -> who may make the change; ``None`` as source means "created". A run closes
#: when its last task becomes terminal, by whoever made that happen; only an operator's retry,
#: clear or mark reopens a finished run, and a CANCELLED run stays cancelled.
RUN_TRANSITIONS: dict[tuple[RunState | None, RunState], frozenset[str]] = {
    (None, RunState.RUNNING): frozenset({"submit"}),
    (RunState.RUNNING, RunState.SUCCEEDED): frozenset({"worker", "submit", "reconciler", "operator", "event"}),
    (RunState.RUNNING, RunState.FAILED): frozenset({"worker", "submit", "reconciler", "operator", "event"}),
    # the reconciler cancels a run that missed a deadline when its DAG says on_deadline="cancel"
    # ... and a submit cancels a held run of its concurrency key (skip, replace_queued, a debounce's merge)
    (RunState.RUNNING, RunState.CANCELLED): frozenset({"operator", "reconciler", "submit"}),
    (RunState.FAILED, RunState.RUNNING): frozenset({"operator"}),
    # an operator's clear or mark reopens a finished run
    (RunState.SUCCEEDED, RunState.RUNNING): frozenset({"operator"}),
}


def check_run_transition(src: RunState | None, dst: RunState, actor: str) -> None:
    """Raise :class:`IllegalTransition` unless ``actor`` may move a run from ``src`` to ``dst``."""
    allowed = RUN_TRANSITIONS.get((src, dst))
    if allowed is None or actor not in allowed:
        origin = src.value if src else "nothing"
        raise IllegalTransition(f"{actor} may not move a run from {origin} to {dst.value}")


#: ledger rows that record a fact about a task or a run without changing its state: the
#: event's ``kind`` column names it (``NULL`` for every transition), its ``from_state`` and
#: ``to_state`` are both the state the row held, and only the roles listed may write it.
#: ``deadline_missed``: the reconciler found a run or task not done by its deadline
#: (``store/deadlines.py``; at most one per run and per task).
DEADLINE_MISSED = "deadline_missed"
#: ``removed``: an operator's clear expands a map again, and its old child (row deleted) is
#: kept in the ledger with this row (its ``result`` the outcome it had), never counted again
REMOVED = "removed"
#: ``stuck``: the reconciler's watchdog flagged the task (``store/recovery.py``: no live worker
#: can take it, its message was re-published without a claim, or its run had no transition)
STUCK = "stuck"
#: ``child_run``: a child-run node's attempt started its child run (``store/children.py``; the
#: reason names the child), or a parent's child run was cancelled by its ``on_parent_end`` policy
CHILD_RUN = "child_run"
#: ``held`` / ``released``: keyed flow control held a run (why, in its reason) or released it
#: (``store/flow.py``); ``held`` also marks a run that a newer submit cancels (``cancel_running``)
FLOW_HELD = "held"
FLOW_RELEASED = "released"
ANNOTATIONS: dict[str, frozenset[str]] = {
    FLOW_HELD: frozenset({"submit", "reconciler"}),
    FLOW_RELEASED: frozenset({"submit", "reconciler"}),
    CHILD_RUN: frozenset({"reconciler"}),
    DEADLINE_MISSED: frozenset({"reconciler"}),
    STUCK: frozenset({"reconciler"}),
    REMOVED: frozenset({"operator"}),
}


def check_annotation(kind: str, actor: str) -> None:
    """Raise :class:`IllegalTransition` unless ``actor`` may write an annotation event of ``kind``."""
    allowed = ANNOTATIONS.get(kind)
    if allowed is None or actor not in allowed:
        raise IllegalTransition(f"{actor} may not record a {kind!r} event")


class TriggerRule(enum.StrEnum):
    """When a task with upstream tasks may run: Airflow's 13 rules, spelled and decided as
    Airflow's ``trigger_rule_dep`` does (early verdicts included). They are decided on the
    server, from the task's upstream counters, by ``orc_decide_v2`` (``store/sql/decide.sql``);
    ``always`` makes the task READY at submit. The table is in docs/reference/spec-format.md."""

    ALL_SUCCESS = "all_success"
    ALL_FAILED = "all_failed"
    ALL_DONE = "all_done"
    ALL_DONE_MIN_ONE_SUCCESS = "all_done_min_one_success"
    ALL_DONE_SETUP_SUCCESS = "all_done_setup_success"
    ALL_SKIPPED = "all_skipped"
    ONE_SUCCESS = "one_success"
    ONE_FAILED = "one_failed"
    ONE_DONE = "one_done"
    NONE_FAILED = "none_failed"
    NONE_FAILED_MIN_ONE_SUCCESS = "none_failed_min_one_success"
    NONE_SKIPPED = "none_skipped"
    ALWAYS = "always"


class SkipReason(enum.StrEnum):
    """Why a task is SKIPPED (``orc_tasks.skip_reason``, shown by explain and the run page)."""

    BRANCH_NOT_TAKEN = "branch_not_taken"
    SHORT_CIRCUIT = "short_circuit"
    EMPTY_MAP = "empty_map"
    UPSTREAM_SKIPPED = "upstream_skipped"
    USER = "user"
    #: a wait (or a sensor, a deferred body) whose deadline passed with ``on_timeout="skip"``
    WAIT_TIMEOUT = "wait_timeout"


def run_outcome(failed_tasks: int) -> RunState:
    """The final state of a run whose tasks are all terminal."""
    return RunState.FAILED if failed_tasks else RunState.SUCCEEDED
