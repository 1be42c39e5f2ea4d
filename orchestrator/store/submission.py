"""Submission: a validated DAG becomes a run, its tasks, edges and first events in one
transaction, idempotent on (DAG name, tenant, idempotency key)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..core.dag import DAG, MAP_MARK, Node, expand_resources
from ..core.dag.passing import placeholder
from ..core.dag.scopes import setup_scopes
from ..core.errors import IdempotencyConflict, ValidationError
from ..core.models import SUBMIT, Actor
from ..core.states import RunState, TaskState, TriggerRule, check_transition
from . import schema as s
from .database import Database
from .dbtime import aware, db_now
from .ledger import Ledger
from .shards import stored_shard
from .stripes import FANIN_STRIPES, Striped, fan_in_stripes

T = TaskState
t_tasks, t_runs, t_edges, t_keys, t_stripes = s.tasks, s.runs, s.edges, s.idempotency_keys, s.stripes


class Submission:
    def __init__(self, db: Database, ledger: Ledger) -> None:
        self.db = db
        self.ledger = ledger

    def create_run(
        self,
        dag: DAG,
        *,
        queues: dict[str, str],
        wants_upstream: Callable[[str], bool],
        idempotency_key: str | None = None,
        logical_date: str | None = None,
        schedule: str | None = None,
        dag_version: int | None = None,
        trigger: str | None = None,
        trace_context: dict[str, str] | None = None,
        code_version: str | None = None,
        default_max_active: int | None = None,
        stripes: int = FANIN_STRIPES,
        tags: dict[str, str] | None = None,
        parent: tuple[str, str, int] | None = None,
        link: Callable[[Connection, str], None] | None = None,
        hold: Callable[[Connection, str, dict[str, Any]], bool] | None = None,
    ) -> tuple[str, bool]:
        """Insert the run, its tasks, edges and first events in one transaction.

        Returns ``(run_id, created)``; with an ``idempotency_key`` already used for this DAG
        name and tenant, or a ``schedule`` that already has a run for ``logical_date``, the
        existing run id and ``False``. ``queues`` maps node key to queue. A key already used by
        a run of another DAG body or other ``params`` (compared as the stored snapshot, see
        :func:`canonical_snapshot`) raises :class:`IdempotencyConflict`, naming that run; so does a
        key whose run ``db clean`` removed (kept in ``orc_idempotency_keys`` for its retention).

        Deadlines (the DAG's and the nodes') fall due that many seconds after ``logical_date``
        (an ISO-8601 date or date-time; without a zone it is UTC) or, without one, after the
        submit by the database clock. ``trace_context`` (the submitter's W3C trace headers) and
        ``code_version`` (the run's pin) are kept on the run's row; ``default_max_active`` is the
        run's ``max_active_tasks`` when its DAG sets none (``ORCHESTRATOR_RUN_MAX_ACTIVE_TASKS``);
        ``tags`` (checked by :func:`orchestrator.core.tags.check_tags`) are the run's
        ``orc_runs.tags`` (a submit that finds its run by its idempotency key or schedule instant
        returns that run with the tags it was created with).
        Raises :class:`ValidationError`, before anything is written, when a deadline after the
        logical date is beyond what a date can hold. A child run records its ``parent`` (run, key,
        attempt); ``link(conn, run_id)`` runs in its transaction (``ChildRows.link``: the parent's CAS);
        ``hold(conn, run_id, row)`` (``FlowRows.decide``) before the run is written: ``True`` holds the run.
        ``stripes``: the striped fan-ins' stripes (``ORCHESTRATOR_FANIN_STRIPES``, :func:`fan_in_stripes`)."""
        base = _checked(dag, logical_date)

        def existing(conn: Connection) -> str | None:
            return _existing(conn, dag, schedule, logical_date, idempotency_key)

        def insert(conn: Connection) -> tuple[str, bool]:
            found = existing(conn)
            if found:
                return found, False
            run_id = self.db.new_id()
            now = conn.execute(sa.select(db_now())).scalar_one()
            due = _due(base if base is not None else _utc(now), dag) if dag.has_deadlines else {}
            row = _run_row(run_id, dag, now, due, idempotency_key, logical_date, schedule, dag_version, trigger)
            row.update(trace_context=trace_context, code_version=code_version, tags=tags or {})
            if dag.max_active_tasks is None and default_max_active is not None:
                row["max_active_tasks"] = default_max_active  # ORCHESTRATOR_RUN_MAX_ACTIVE_TASKS
            row.update(zip(("parent_run_id", "parent_key", "parent_attempt"), parent or (), strict=False))
            held = hold is not None and hold(conn, run_id, row)
            conn.execute(t_runs.insert().values(**row, shard=stored_shard(run_id)))
            self.ledger.create_run(conn, run_id, SUBMIT)
            striped = fan_in_stripes(dag, stripes)
            rows = _task_rows(dag, run_id, now, queues, wants_upstream, due, striped.of)
            self._tasks(conn, run_id, dag, rows, held, striped)
            if link is not None:
                link(conn, run_id)
            return run_id, True

        try:
            return self.db.transaction(insert)
        except sa.exc.IntegrityError as exc:
            # a concurrent submit with the same idempotency key (or a schedule's instant) won
            # the unique constraint: its run is the answer
            with self.db.engine.begin() as conn:
                found = existing(conn)
            if found is None:
                raise _not_stored(exc, dag) from exc
            return found, False

    def _tasks(
        self, conn: Connection, run_id: str, dag: DAG, rows: Iterator[dict[str, Any]], held: bool, striped: Striped
    ) -> None:
        """The run's tasks, edges and stripes written, then its roots started (a held run's: none,
        all PENDING)."""
        self.db.backend.bulk_insert(conn, t_tasks, _held_rows(rows) if held else rows)
        self.db.backend.bulk_insert(conn, t_edges, _edge_rows(dag, run_id))
        if striped.quotas:
            self.db.backend.bulk_insert(conn, t_stripes, striped.rows(run_id))
        if not held:
            self.start_roots(conn, run_id, dag)

    def start_roots(self, conn: Connection, run_id: str, dag: DAG, *, released: bool = False) -> None:
        """The run's roots start: plain ones READY, a map expanded, a wait node waiting. A run
        keyed flow control ``released`` (its tasks inserted PENDING): its roots move READY now."""
        starting = [n.key for n in dag.nodes.values() if _starts(n) and n.map is None and not _waits(n)]
        if released:
            where = (t_tasks.c.run_id == run_id, t_tasks.c.key.in_(starting))
            values = {"ready_at": db_now()}
            self.ledger.move_many(conn, where, T.PENDING, T.READY, Actor("reconciler"), reason="root", values=values)
        else:
            self.ledger.roots_ready(conn, run_id, starting)
        for node in dag.nodes.values():
            if _starts(node) and node.map is not None:
                self._expand_root(conn, run_id, node.key)
        waits = [n.key for n in dag.nodes.values() if _starts(n) and _waits(n)]
        if waits:
            self._wait_roots(conn, run_id, waits)

    def link_rerun(self, run_id: str, first: str) -> None:
        """Record that ``run_id`` runs ``first`` again (``orchestrator rerun``)."""
        with self.db.engine.begin() as conn:
            conn.execute(t_runs.update().where(t_runs.c.id == run_id).values(rerun_of=first))

    def _wait_roots(self, conn: Connection, run_id: str, keys: list[str]) -> None:
        """The wait nodes that start with their run begin to wait now (``orc_wait_v1``, one round
        trip for all of them); one whose event had come or whose instant is past ends at once and
        is settled."""
        check_transition(T.PENDING, T.WAITING, SUBMIT.role)
        began = conn.execute(
            sa.text("SELECT k, orc_wait_v1(:run, k, 'submit', NULL, 'root') FROM unnest(CAST(:keys AS text[])) AS k"),
            {"run": run_id, "keys": keys},
        ).all()
        for key, out in began:
            if out is not None and out["state"] != T.WAITING.value:
                conn.execute(
                    sa.text("SELECT orc_settle_v2(:run, :key, :state, CAST(:children AS json), 'submit', NULL)"),
                    {"run": run_id, "key": key, "state": out["state"], "children": json.dumps(out.get("children"))},
                )

    def _expand_root(self, conn: Connection, run_id: str, key: str) -> None:
        """A mapped node that starts with its run (its items are literal lists) becomes its
        children now (``orc_expand_v1``); an empty one ends at once and is settled."""
        check_transition(T.PENDING, T.MAPPED, SUBMIT.role)
        out = conn.execute(
            sa.text("SELECT orc_expand_v1(:run, :key, 'submit', NULL, 'root')"), {"run": run_id, "key": key}
        ).scalar_one()
        if out is not None and out["state"] != T.MAPPED.value:
            conn.execute(
                sa.text("SELECT orc_settle_v2(:run, :key, :state, CAST(:children AS json), 'submit', NULL)"),
                {"run": run_id, "key": key, "state": out["state"], "children": json.dumps(out["children"])},
            )


def _held_rows(rows: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """A held run's task rows (keyed flow control): every one PENDING, its roots too."""
    for row in rows:
        if row["state"] == T.READY.value:
            row = {**row, "state": T.PENDING.value, "ready_at": None}
        yield row


def _starts(node: Node) -> bool:
    """Whether the node may start with its run: a root, or a node whose rule is ``always``."""
    return not node.upstream or node.trigger_rule is TriggerRule.ALWAYS


def canonical_snapshot(snapshot: Any) -> str:
    """The form two submissions are compared in: the DAG snapshot as it is stored
    (``DAG.to_spec()`` as JSON, which holds the ``params`` too), with its nodes in key order
    and its object keys sorted, so an equal DAG built in another order is the same body."""
    plain = json.loads(json.dumps(snapshot))  # tuples, enum members: as the JSON column stores them
    if isinstance(plain, dict) and isinstance(plain.get("nodes"), list):
        plain["nodes"] = sorted(plain["nodes"], key=lambda n: str(n.get("key")) if isinstance(n, dict) else "")
        for node in plain["nodes"]:
            # sets of names (upstream may be given as a set, whose order varies between processes)
            for field in ("upstream", "retry_on", "no_retry_on"):
                if isinstance(node, dict) and isinstance(node.get(field), list):
                    node[field] = sorted(node[field], key=str)
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _same_submission(dag: DAG, key: str, run_id: str, snapshot: Any, params: Any) -> None:
    """Raise :class:`IdempotencyConflict` unless ``dag`` is the DAG (body and params) that the
    run ``run_id`` stored under the idempotency ``key``."""
    if canonical_snapshot(snapshot) == canonical_snapshot(dag.to_spec()):
        return
    same_params = canonical_snapshot(params) == canonical_snapshot(dag.params)
    what = "another DAG body" if same_params else "other params"
    raise IdempotencyConflict(
        f"idempotency key {key!r} was used by run {run_id} with {what}; submit the same DAG and params"
        " to get that run back, or use another key",
        run_id=run_id,
        idempotency_key=key,
        dag=dag.name,
    )


def _not_removed(conn: Connection, dag: DAG, key: str) -> None:
    """Raise :class:`IdempotencyConflict` when ``db clean`` removed the run that ``key`` named
    (its key is kept, ``orc_idempotency_keys``): a retried request never starts a second run."""
    kept = conn.execute(
        sa.select(t_keys).where(
            t_keys.c.dag_name == dag.name, t_keys.c.tenant == dag.tenant, t_keys.c.idempotency_key == key
        )
    ).first()
    if kept is None:
        return
    raise IdempotencyConflict(
        f"idempotency key {key!r} was used by run {kept.run_id} ({kept.state}, created"
        f" {_utc(kept.created_at).isoformat(timespec='seconds')}), removed by db clean at"
        f" {_utc(kept.removed_at).isoformat(timespec='seconds')}: its outcome is no longer stored; use another key to"
        " run it again (a removed run's key is kept for db clean --keep-keys, 90 days by default)",
        run_id=kept.run_id,
        idempotency_key=key,
        dag=dag.name,
    )


def _logical_base(logical_date: str) -> dt.datetime:
    """The instant deadlines count from: the logical date, UTC when it names no zone (a bare
    date is its midnight). ``submit`` has checked that it is ISO-8601."""
    try:
        base = dt.datetime.fromisoformat(logical_date)
    except ValueError:
        raise ValidationError(f"logical_date {logical_date!r} is not an ISO-8601 date or date-time") from None
    return base.replace(tzinfo=dt.UTC) if base.tzinfo is None else base.astimezone(dt.UTC)


def _utc(value: Any) -> dt.datetime:
    """A timestamp as an aware UTC datetime (naive ones taken as UTC)."""
    moment = aware(value)
    assert moment is not None
    return moment.astimezone(dt.UTC)


def _due(base: dt.datetime, dag: DAG) -> dict[str | None, dt.datetime]:
    """When each deadline falls due (UTC): ``None`` for the run's, node keys for the nodes'."""
    due: dict[str | None, dt.datetime] = {}
    try:
        if dag.deadline is not None:
            due[None] = base + dt.timedelta(seconds=float(dag.deadline))
        for node in dag.nodes.values():
            if node.deadline is not None:
                due[node.key] = base + dt.timedelta(seconds=float(node.deadline))
    except OverflowError:
        raise ValidationError(
            f"deadline: {base.isoformat()} plus the deadline is past the year 9999", dag=dag.name
        ) from None
    return due


def _checked(dag: DAG, logical_date: str | None) -> dt.datetime | None:
    """What a submit checks before its transaction: the resources' names, and a logical date
    whose deadlines a date cannot hold (near year 9999). Returns the deadlines' base, if any."""
    for node in dag.nodes.values():
        if node.resources:
            expand_resources(node.resources, dag.tenant, dag=dag.name, node=node.key)
    base = _logical_base(logical_date) if logical_date is not None and dag.has_deadlines else None
    if base is not None:
        _due(base, dag)
    return base


def _task_rows(
    dag: DAG,
    run_id: str,
    now: Any,
    queues: dict[str, str],
    wants_upstream: Callable[[str], bool],
    due: dict[str | None, dt.datetime],
    stripe_of: dict[str, int],
) -> Iterator[dict[str, Any]]:
    """The task rows of a new run, one at a time (a 100,000-node run is never all in memory as
    rows); roots start READY, the others PENDING; ``stripe_of``: the striped parents' stripes.
    The deadline columns are in the rows only when some node has a deadline (every row has the
    same columns: the COPY takes them from the first)."""
    node_deadlines = any(n.deadline is not None for n in dag.nodes.values())
    uses_resources = any(n.resources for n in dag.nodes.values())
    children: dict[str, list[str]] = {}
    for node in dag.nodes.values():
        for parent in node.upstream:
            children.setdefault(parent, []).append(node.key)
    # the columns of maps, branches, skips and setups: in the rows only when a node uses one
    deciders = dag.deciders()
    scopes = setup_scopes(dag.nodes)
    scope_of: dict[str, list[str]] = {}
    for key, ups in scopes.items():
        for up in ups:
            scope_of.setdefault(up, []).append(key)
    dynamic = deciders is not None or any(_dynamic(n) for n in dag.nodes.values())
    setups = {n.key for n in dag.nodes.values() if n.setup}
    map_sources = _map_sources(dag)
    # equal JSON values are shared objects, so the bulk insert encodes each one once
    empty_args: list[Any] = []
    empty_kwargs: dict[str, Any] = {}
    backoffs: dict[Any, dict[str, Any]] = {}
    for node in dag.nodes.values():
        prio = dag.priority_of(node)
        root = _starts(node) and node.map is None and not _waits(node)
        backoff = backoffs.get(node.backoff)
        if backoff is None:
            backoff = backoffs[node.backoff] = node.backoff.to_spec()
        yield {
            "run_id": run_id,
            "key": node.key,
            "task_name": node.task,
            "args": list(node.args) if node.args else empty_args,
            "kwargs": _row_kwargs(dag, node) if node.kwargs or node.map is not None else empty_kwargs,
            "state": (T.READY if root else T.PENDING).value,
            "attempt": 1,
            "max_attempts": node.max_attempts,
            "backoff": backoff,
            "trigger_rule": node.trigger_rule.value,
            "n_upstream": len(node.upstream),
            "n_done": 0,
            "n_succeeded": 0,
            "n_failed": 0,
            "n_skipped": 0,
            "wants_upstream": wants_upstream(node.task) or placeholder(node.args) is not None,
            "queue": queues[node.key],
            "priority": prio.value,
            "priority_rank": prio.rank,
            "tenant": dag.tenant,
            "soft_time_limit": node.soft_time_limit,
            "time_limit": node.time_limit,
            "ready_at": now if root else None,
            "children": children.get(node.key),
            "retry_on": list(node.retry_on) or None,
            "no_retry_on": list(node.no_retry_on) or None,
            "pool": node.pool,
            "pool_slots": node.pool_slots,
            "rate_limit": node.rate_limit,
            "stripe": stripe_of.get(node.key),
            **({"resources": expand_resources(node.resources, dag.tenant)} if uses_resources else {}),
            **({"deadline_seconds": node.deadline, "deadline_at": due.get(node.key)} if node_deadlines else {}),
            **(_dynamic_columns(dag, node, setups, map_sources, deciders) if dynamic else {}),
            **({"setup_scope": scopes.get(node.key), "scope_of": scope_of.get(node.key)} if scopes else {}),
        }


def _map_sources(dag: DAG) -> set[str]:
    """The nodes whose result a map (not per item) maps over: their success checks the result."""
    return {
        a.source
        for n in dag.nodes.values()
        if n.map is not None and dag.per_item(n) is None
        for a in n.map.args
        if a.source is not None
    }


def _row_kwargs(dag: DAG, node: Node) -> dict[str, Any]:
    """A task row's kwargs: the node's, and for a map whose worker finishes each child's item
    (a transform, a ``kwargs_from`` item given at claim time) the :data:`MAP_MARK` entry."""
    kwargs = dict(node.kwargs)
    mark = None if node.map is None else node.map.worker_mark(dag.per_item(node) is not None)
    if mark is not None:
        kwargs[MAP_MARK] = mark
    return kwargs


def _dynamic(n: Node) -> bool:
    """Whether a node uses a column of maps, branches, skips, setups, waits or transactions."""
    return (
        n.map is not None
        or n.branch
        or n.short_circuit
        or n.setup
        or n.teardown
        or n.min_success_ratio is not None
        or _waits(n)
        or n.sensor is not None
        or n.transactional
    )


def _dynamic_columns(
    dag: DAG, node: Node, setups: set[str], map_sources: set[str], deciders: set[str] | None
) -> dict[str, Any]:
    """A task row's columns of maps, branches, skips, setups, teardowns and transactions. ``deciders``: the
    nodes whose failure fails the run under ``run_state="leaves"`` (``None``: every node that is
    not a map header or a teardown)."""
    decides = node.key in deciders if deciders is not None else not (node.teardown and not node.fails_run)
    return {
        "n_setup": sum(1 for p in node.upstream if p in setups),
        "role": "setup" if node.setup else "teardown" if node.teardown else None,
        "decides_run": node.map is None and decides,
        "flow": _flow(node),
        "feeds_map": node.key in map_sources,
        "min_success_ratio": node.min_success_ratio,
        "map_spec": None if node.map is None else node.map.to_row(dag.per_item(node), decides=decides),
        "wait_spec": _wait_row(node),
        "transactional": node.transactional or None,
    }


def _edge_rows(dag: DAG, run_id: str) -> Iterator[dict[str, Any]]:
    for node in dag.nodes.values():
        for parent in node.upstream:
            yield {"run_id": run_id, "parent_key": parent, "child_key": node.key}


def _existing(
    conn: Connection, dag: DAG, schedule: str | None, logical_date: str | None, idempotency_key: str | None
) -> str | None:
    """The run this submit already made: the schedule's run of ``logical_date``, or the run of the
    idempotency key (the same submission, else :class:`IdempotencyConflict`)."""
    found: str | None = None
    if schedule is not None and logical_date is not None:
        found = conn.execute(
            sa.select(t_runs.c.id).where(
                t_runs.c.schedule == schedule,
                t_runs.c.logical_date == logical_date,
                t_runs.c.tenant == dag.tenant,
            )
        ).scalar_one_or_none()
    if found is None and idempotency_key is not None:
        row = conn.execute(
            sa.select(t_runs.c.id, t_runs.c.dag_snapshot, t_runs.c.params).where(
                t_runs.c.dag_name == dag.name,
                t_runs.c.tenant == dag.tenant,
                t_runs.c.idempotency_key == idempotency_key,
            )
        ).first()
        if row is not None:
            _same_submission(dag, idempotency_key, row.id, row.dag_snapshot, row.params)
            found = row.id
        else:
            _not_removed(conn, dag, idempotency_key)
    return found


def _run_row(
    run_id: str, dag: DAG, now: Any, due: dict[str | None, Any], idempotency_key: str | None, logical_date: str | None,
    schedule: str | None, dag_version: int | None, trigger: str | None,
) -> dict[str, Any]:  # fmt: skip
    """The run's row as a submit inserts it."""
    return dict(
        id=run_id,
        dag_name=dag.name,
        tenant=dag.tenant,
        state=RunState.RUNNING.value,
        priority=dag.priority.value,
        idempotency_key=idempotency_key,
        logical_date=logical_date,
        params=dag.params,
        dag_snapshot=dag.to_spec(),
        task_count=len(dag.nodes),
        open_tasks=len(dag.nodes),
        max_active_tasks=dag.max_active_tasks,
        created_at=now,
        schedule=schedule,
        dag_version=dag_version,
        trigger=trigger,
        deadline_seconds=dag.deadline,
        deadline_at=due.get(None),
        on_deadline=dag.on_deadline.value if dag.has_deadlines else None,
    )


def _flow(node: Node) -> str | None:
    """A task row's ``flow``: what its success leaves out (``orc_follow_v1``), or a wait."""
    if node.branch:
        return "branch"
    if node.short_circuit:
        # Airflow's ignore_downstream_trigger_rules=False: only the direct children are skipped
        return "short_circuit" if node.ignore_downstream_trigger_rules else "circuit_direct"
    return "wait" if _waits(node) else None


def _not_stored(exc: sa.exc.IntegrityError, dag: DAG) -> ValidationError:
    """Nothing was written (the transaction rolled back): a typed refusal, never a raw driver
    error (validation refuses every shape known to reach here)."""
    constraint = getattr(getattr(exc.orig, "diag", None), "constraint_name", None) or "a unique key"
    return ValidationError(
        f"the run could not be stored: it would repeat {constraint} ({type(exc.orig).__name__})", dag=dag.name
    )


def _wait_row(node: Node) -> dict[str, Any] | None:
    """A task row's ``wait_spec``: a wait node's, a sensor's or a child-run node's."""
    spec = node.wait or node.sensor or node.child
    return spec.to_row() if spec is not None else None


def _waits(node: Node) -> bool:
    """Whether a node waits as a row when its rule says READY: a wait node or a child-run node."""
    return node.wait is not None or node.child is not None
