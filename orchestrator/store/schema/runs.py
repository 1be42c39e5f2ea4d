"""Runs and their tasks: the run and task rows, the DAG's edges, the ledger of transitions, and the
idempotency keys of removed runs."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from .base import TS, metadata

runs = sa.Table(
    "orc_runs",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("dag_name", sa.String(200), nullable=False),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("priority", sa.String(16), nullable=False),
    sa.Column("idempotency_key", sa.String(200), nullable=True),
    sa.Column("logical_date", sa.String(64), nullable=True),
    sa.Column("params", sa.JSON, nullable=False),
    sa.Column("dag_snapshot", sa.JSON, nullable=False),
    sa.Column("task_count", sa.Integer, nullable=False),
    #: tasks not yet terminal; the run ends when it reaches 0
    sa.Column("open_tasks", sa.Integer, nullable=False),
    #: most tasks of this run QUEUED or RUNNING at once (the DAG's max_active_tasks; null: no limit)
    sa.Column("max_active_tasks", sa.Integer, nullable=True),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("finished_at", TS, nullable=True),
    #: the schedule that fired the run (``orc_schedules``), with ``logical_date`` its instant:
    #: one run per (schedule, instant), however many beats or backfills try
    sa.Column("schedule", sa.String(200), nullable=True),
    #: the DAG's ``deadline`` (seconds) and when it falls due: that long after the logical date,
    #: or after the submit (database clock) for a run without one; null: no run deadline
    sa.Column("deadline_seconds", sa.Float, nullable=True),
    sa.Column("deadline_at", TS, nullable=True),
    #: what a missed deadline of the run or of one of its tasks does: ``alert`` or ``cancel``
    #: (null when neither the DAG nor any node sets a deadline)
    sa.Column("on_deadline", sa.String(8), nullable=True),
    #: when the reconciler judged the run's deadline (once, after it fell due: the
    #: compare-and-set ``WHERE deadline_checked_at IS NULL``), and, if the run was not final by
    #: then, when it recorded the miss (with its ``deadline_missed`` event, in one transaction)
    sa.Column("deadline_checked_at", TS, nullable=True),
    sa.Column("deadline_missed_at", TS, nullable=True),
    #: ``orchestrator rerun``: the run this one runs again (the same DAG snapshot and params)
    sa.Column("rerun_of", sa.String(32), nullable=True),
    #: the registered version (``orc_dag_versions``) the run was made from: ``submit --dag
    #: NAME[@N]``, ``submit_registered`` or a schedule on a registered DAG; null for a DAG
    #: submitted as a spec or an object
    sa.Column("dag_version", sa.Integer, nullable=True),
    #: the event trigger (``orc_triggers``) that started the run, with the event's id as its
    #: idempotency key: one run per (trigger, event)
    sa.Column("trigger", sa.String(200), nullable=True),
    #: the watchdog's flag (``Recovery.watch``): why the run needs a person (a task of it no
    #: worker can take, re-published without a claim, or no transition for too long); null: none
    sa.Column("stuck", sa.Text, nullable=True),
    #: the submitter's trace context (W3C ``traceparent``/``tracestate``, captured at submit when
    #: OpenTelemetry is installed): every message of the run carries it, whoever publishes it
    sa.Column("trace_context", sa.JSON, nullable=True),
    #: the code version the run is pinned to (``submit(..., code_version=)``): its tasks go only
    #: to workers advertising that version (``orc_workers.code_version``); null: any worker
    sa.Column("code_version", sa.String(64), nullable=True),
    #: the run's tags (``submit(..., tags={"customer": "42"})``, :mod:`orchestrator.core.tags`):
    #: a JSON object of text values, ``{}`` for a run without; filtered by containment (``@>``)
    sa.Column("tags", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    #: a child run (``DAG.run_dag``): the parent run, node key and attempt that started it (one
    #: child per attempt: its idempotency key says so); null for a run that is no child
    sa.Column("parent_run_id", sa.String(32), nullable=True),
    sa.Column("parent_key", sa.String(200), nullable=True),
    sa.Column("parent_attempt", sa.Integer, nullable=True),
    #: keyed flow control (``submit(..., concurrency_key=...)``, :mod:`orchestrator.core.flow`):
    #: the key (per tenant), the run's options (``FlowControl.to_row``), why it is held (``concurrency``,
    #: ``throttle``, ``debounce``; null: not held, its roots started), until when (a debounce's quiet
    #: end, a throttle's next slot), the first submit of its debounce burst, when it was admitted
    sa.Column("flow_key", sa.String(200), nullable=True),
    sa.Column("flow", sa.JSON, nullable=True),
    sa.Column("held", sa.String(16), nullable=True),
    sa.Column("held_until", TS, nullable=True),
    sa.Column("flow_first_at", TS, nullable=True),
    sa.Column("flow_admitted_at", TS, nullable=True),
    #: the reconciler shard of the run (``store.shards.shard_of``: hash of the id mod the
    #: deployment's shard count), set at submit once ``orc_shard_config`` exists; null on older
    #: runs, whose shard the same expression computes where it is read (no row rewritten)
    sa.Column("shard", sa.Integer, nullable=True),
    sa.UniqueConstraint("dag_name", "tenant", "idempotency_key", name="uq_orc_runs_idempotency"),
    #: per tenant: two tenants' schedules may share a name (``orc_schedules`` is keyed by both)
    sa.UniqueConstraint("tenant", "schedule", "logical_date", name="uq_orc_runs_schedule_instant"),
)
sa.Index("ix_orc_runs_created", runs.c.created_at)
#: the runs list filtered by tenant, DAG or state, newest first (the web app, `orchestrator runs`)
sa.Index("ix_orc_runs_tenant_created", runs.c.tenant, runs.c.created_at)
sa.Index("ix_orc_runs_dag_created", runs.c.dag_name, runs.c.created_at)
sa.Index("ix_orc_runs_state_created", runs.c.state, runs.c.created_at)
sa.Index("ix_orc_runs_schedule_state", runs.c.schedule, runs.c.state)
#: runs by their tags (``tags @> '{"customer": "42"}'``: the runs list's and bulk actions' tag
#: filter); ``jsonb_path_ops`` indexes containment only, smaller and faster than the default
sa.Index("ix_orc_runs_tags", runs.c.tags, postgresql_using="gin", postgresql_ops={"tags": "jsonb_path_ops"})
#: keyed flow control: a key's runs by state (partial: runs without a key are not in it)
sa.Index(
    "ix_orc_runs_flow_key",
    runs.c.tenant,
    runs.c.flow_key,
    runs.c.state,
    postgresql_where=sa.text("flow_key IS NOT NULL"),
)
#: the reconciler's flow pass: the held runs (partial: every other run is not in it)
sa.Index(
    "ix_orc_runs_flow_held",
    runs.c.created_at,
    postgresql_where=sa.text("held IS NOT NULL AND state = 'RUNNING'"),
)
#: the reconciler's deadline check: runs whose deadline is not judged yet, by due time (partial:
#: runs without a deadline, and runs already judged, are not in it)
DEADLINE_PENDING = "deadline_at IS NOT NULL AND deadline_checked_at IS NULL"
sa.Index(
    "ix_orc_runs_deadline_due",
    runs.c.deadline_at,
    postgresql_where=sa.text(DEADLINE_PENDING),
)

tasks = sa.Table(
    "orc_tasks",
    metadata,
    #: no foreign key: a run and its tasks are written by one transaction (submission), and a
    #: per-row key check made a 10,000-node COPY measurably slower
    sa.Column("run_id", sa.String(32), primary_key=True),
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("task_name", sa.String(255), nullable=False),
    sa.Column("args", sa.JSON, nullable=False),
    sa.Column("kwargs", sa.JSON, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("max_attempts", sa.Integer, nullable=False),
    sa.Column("backoff", sa.JSON, nullable=False),
    sa.Column("trigger_rule", sa.String(32), nullable=False),
    sa.Column("n_upstream", sa.Integer, nullable=False),
    sa.Column("n_done", sa.Integer, nullable=False),
    sa.Column("n_succeeded", sa.Integer, nullable=False),
    #: parents (a mapped parent: its children) that ended FAILED, UPSTREAM_FAILED, SKIPPED
    sa.Column("n_failed", sa.Integer, nullable=False),
    sa.Column("n_upstream_failed", sa.Integer, nullable=False, server_default="0"),
    sa.Column("n_skipped", sa.Integer, nullable=False),
    #: parents that are setup tasks, and of them those that succeeded / were skipped
    #: (``all_done_setup_success``)
    sa.Column("n_setup", sa.Integer, nullable=False, server_default="0"),
    sa.Column("n_setup_ok", sa.Integer, nullable=False, server_default="0"),
    sa.Column("n_setup_skipped", sa.Integer, nullable=False, server_default="0"),
    sa.Column("wants_upstream", sa.Boolean, nullable=False),
    sa.Column("queue", sa.String(200), nullable=False),
    sa.Column("priority", sa.String(16), nullable=False),
    sa.Column("priority_rank", sa.SmallInteger, nullable=False),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("soft_time_limit", sa.Float, nullable=True),
    sa.Column("time_limit", sa.Float, nullable=True),
    sa.Column("not_before", TS, nullable=True),
    sa.Column("ready_at", TS, nullable=True),
    sa.Column("dispatched_at", TS, nullable=True),
    sa.Column("started_at", TS, nullable=True),
    sa.Column("heartbeat_at", TS, nullable=True),
    sa.Column("lease_expires_at", TS, nullable=True),
    sa.Column("finished_at", TS, nullable=True),
    sa.Column("worker", sa.String(255), nullable=True),
    sa.Column("result", sa.JSON, nullable=True),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("fingerprint", sa.String(64), nullable=True),
    #: child keys, so a finishing task reaches its children by primary key
    sa.Column("children", sa.JSON, nullable=True),
    sa.Column("retry_on", sa.JSON, nullable=True),
    sa.Column("no_retry_on", sa.JSON, nullable=True),
    #: consecutive failed attempts with the same fingerprint (poison detection)
    sa.Column("fingerprint_streak", sa.Integer, nullable=False, server_default="0"),
    #: consecutive attempts that lost their lease without an exception (crash loop detection)
    sa.Column("lease_losses", sa.Integer, nullable=False, server_default="0"),
    #: the pool (``orc_pools``) whose slots the task holds while QUEUED or RUNNING, and how many
    sa.Column("pool", sa.String(64), nullable=True),
    sa.Column("pool_slots", sa.Integer, nullable=False, server_default="1"),
    #: the rate limit (``orc_rate_limits``) each admission of the task takes a token of
    sa.Column("rate_limit", sa.String(64), nullable=True),
    #: the resources the task uses (``resources=[...]``, ``{tenant}`` expanded): their circuit
    #: breakers (``orc_breakers``) count its outcomes and hold it READY while open; null: none
    sa.Column("resources", postgresql.ARRAY(sa.Text), nullable=True),
    #: the node's ``deadline`` (seconds after the run's logical date, or its submit) and when it
    #: falls due; the verdict and the miss as on ``orc_runs`` (done = in a terminal state)
    sa.Column("deadline_seconds", sa.Float, nullable=True),
    sa.Column("deadline_at", TS, nullable=True),
    sa.Column("deadline_checked_at", TS, nullable=True),
    sa.Column("deadline_missed_at", TS, nullable=True),
    #: ``setup`` or ``teardown`` (Airflow's setup and teardown tasks), or null
    sa.Column("role", sa.String(16), nullable=True),
    #: whether the task ending FAILED / UPSTREAM_FAILED fails its run (not a teardown unless it
    #: asked to, not a map's header)
    sa.Column("decides_run", sa.Boolean, nullable=False, server_default=sa.true()),
    #: ``branch`` (its result names the children followed) or ``short_circuit`` (a falsy result
    #: skips everything downstream), or null
    sa.Column("flow", sa.String(16), nullable=True),
    #: a map maps over this task's result (its success checks the result first)
    sa.Column("feeds_map", sa.Boolean, nullable=False, server_default=sa.false()),
    #: why a SKIPPED task was skipped: branch_not_taken, short_circuit, empty_map,
    #: upstream_skipped, user
    sa.Column("skip_reason", sa.String(32), nullable=True),
    #: all_success relaxed: READY once this share of the upstream (a map's children) succeeded
    sa.Column("min_success_ratio", sa.Float, nullable=True),
    #: a mapped node (the map's header): what it maps over (``dag.MapSpec.to_row``); it never
    #: runs itself but becomes its children (MAPPED) and closes after the last of them, with
    #: their counts in ``map_total`` .. ``map_skipped``
    sa.Column("map_spec", sa.JSON, nullable=True),
    #: a child of a map: its header's key, its place and key in the map (the task's key is
    #: ``<header>[<map_key>]``) and, mapped item by item over another map, that map's child whose
    #: result is its item
    sa.Column("map_parent", sa.String(200), nullable=True),
    sa.Column("map_index", sa.Integer, nullable=True),
    sa.Column("map_key", sa.String(100), nullable=True),
    sa.Column("map_item_from", sa.String(200), nullable=True),
    sa.Column("map_total", sa.Integer, nullable=False, server_default="0"),
    sa.Column("map_done", sa.Integer, nullable=False, server_default="0"),
    sa.Column("map_ok", sa.Integer, nullable=False, server_default="0"),
    sa.Column("map_failed", sa.Integer, nullable=False, server_default="0"),
    sa.Column("map_skipped", sa.Integer, nullable=False, server_default="0"),
    #: a map wider than its window: the items not inserted yet (all of them, by map index) and
    #: how many are inserted so far (``orc_map_window_v1``)
    sa.Column("map_items", postgresql.JSONB, nullable=True),
    sa.Column("map_next", sa.Integer, nullable=True),
    #: read by settlement on each child that finishes, so that it need not parse ``map_spec``:
    #: the map's ``max_active`` (null: none), and the count of done children at which its next
    #: window is inserted (null: none left)
    sa.Column("map_max_active", sa.Integer, nullable=True),
    sa.Column("map_refill", sa.Integer, nullable=True),
    #: what the node waits for (``dag.wait``: ``{"kind": "event" | "sleep" | "approval", ...}``,
    #: with ``flow`` = ``wait``: it never runs on a worker) or how it polls (``dag.sensor``:
    #: ``{"kind": "sensor", "every", "timeout", ...}``: its check task runs on a worker)
    sa.Column("wait_spec", sa.JSON, nullable=True),
    #: the wait in progress while WAITING (``orc_wait_begin_v1``, ``orc_defer_v1``): kind, event,
    #: match, until, deadline, on_timeout, the deferred body's state; null otherwise
    sa.Column("waiting", postgresql.JSONB, nullable=True),
    #: while WAITING for an event: its key and the JSON its payload must contain (an emit finds
    #: the waits by key through ``ix_orc_tasks_waiting_event``)
    sa.Column("wait_event", sa.String(200), nullable=True),
    sa.Column("wait_match", postgresql.JSONB, nullable=True),
    #: while WAITING: the earliest instant the reconciler must look at it (the wait's ``until`` or
    #: its deadline, whichever comes first; absolute, fixed when the wait began)
    sa.Column("wake_at", TS, nullable=True),
    #: what a deferred body gets when it is called again (``current_context().resumed``): the
    #: event that woke it and the state it saved
    sa.Column("wait_resume", sa.JSON, nullable=True),
    #: the worker that received the task's message without the task registered (Celery's
    #: ``task_unknown``): the task is held READY until a worker of its queue that has the task
    #: registers (admission skips it); null: not dropped
    sa.Column("dropped_by", sa.String(255), nullable=True),
    #: the watchdog's flag (``Recovery.watch``): ``{"kind": "unregistered" | "republished" |
    #: "idle", "detail", "state", "attempt", "at"}``, cleared when the task moves on; null: none
    sa.Column("stuck", postgresql.JSONB, nullable=True),
    #: Airflow's setup scope: the setups above this task, not its parents, that it works under (no
    #: teardown, or a teardown below it); one that failed or was skipped decides it
    #: UPSTREAM_FAILED or SKIPPED, and it waits for them to finish (null: none)
    sa.Column("setup_scope", postgresql.ARRAY(sa.Text), nullable=True),
    #: on a setup: the tasks whose ``setup_scope`` names it, decided again when it finishes
    sa.Column("scope_of", postgresql.ARRAY(sa.Text), nullable=True),
    #: a child-run node (``DAG.run_dag``): the child run its current attempt started (null until
    #: it is started; a clear or a retry starts another)
    sa.Column("child_run_id", sa.String(32), nullable=True),
    #: ``dag.task(..., transactional=True)``: the body runs in the transaction that commits its
    #: success (``current_context().transaction``); null: not transactional (never a direct message)
    sa.Column("transactional", sa.Boolean, nullable=True),
    #: a parent of a wide fan-in (its only child, a join with at least 4 x stripes such parents,
    #: see ``orc_stripes``): the stripe of the join that counts its arrival; its success is folded
    #: into the join's counters and the run's open count when the stripe's last parent arrives.
    #: Null: counted into its children and the run directly
    sa.Column("stripe", sa.SmallInteger, nullable=True),
)
#: the watchdog's flagged tasks, and the tasks held after a worker dropped their message
sa.Index("ix_orc_tasks_stuck", tasks.c.run_id, postgresql_where=sa.text("stuck IS NOT NULL"))
sa.Index("ix_orc_tasks_dropped", tasks.c.queue, tasks.c.task_name, postgresql_where=sa.text("dropped_by IS NOT NULL"))
#: the waits on an event, by tenant and key (partial: only tasks WAITING for an event)
WAITING_EVENT = "state = 'WAITING' AND wait_event IS NOT NULL"
sa.Index("ix_orc_tasks_waiting_event", tasks.c.tenant, tasks.c.wait_event, postgresql_where=sa.text(WAITING_EVENT))
#: the reconciler's pass over waits due (a sleep over, a deadline passed)
WAITING_DUE = "state = 'WAITING' AND wake_at IS NOT NULL"
sa.Index("ix_orc_tasks_wake_due", tasks.c.wake_at, postgresql_where=sa.text(WAITING_DUE))
#: the child pass over child-run nodes WAITING (to start their child, or to end with it)
WAITING_CHILD = "state = 'WAITING' AND task_name = 'orchestrator.run_dag'"
sa.Index("ix_orc_tasks_child_waiting", tasks.c.run_id, tasks.c.key, postgresql_where=sa.text(WAITING_CHILD))
#: a run's child runs (lineage), and the running ones (the child pass's parent-end policy)
sa.Index("ix_orc_runs_parent", runs.c.parent_run_id, postgresql_where=sa.text("parent_run_id IS NOT NULL"))
CHILD_RUNNING = "parent_run_id IS NOT NULL AND state = 'RUNNING'"
sa.Index("ix_orc_runs_child_running", runs.c.parent_run_id, postgresql_where=sa.text(CHILD_RUNNING))
#: a map's children in map order, those waiting (max_active's next child) and those that
#: succeeded (the join's results); partial: the tasks of no map are not in it, nor a child while
#: it is READY, QUEUED or RUNNING (each of those moves would add an index entry: a map's child
#: then costs one more index entry than a task of a static fan-out, not three)
MAP_CHILD = "map_parent IS NOT NULL AND state IN ('PENDING', 'SUCCEEDED')"
sa.Index(
    "ix_orc_tasks_map_children",
    tasks.c.run_id,
    tasks.c.map_parent,
    tasks.c.map_index,
    postgresql_where=sa.text(MAP_CHILD),
)
sa.Index(
    "ix_orc_tasks_deadline_due",
    tasks.c.deadline_at,
    postgresql_where=sa.text(DEADLINE_PENDING),
)
#: admission: each tenant's first READY task of a queue, and the tasks in flight per queue
sa.Index(
    "ix_orc_tasks_queue_state", tasks.c.queue, tasks.c.state, tasks.c.tenant, tasks.c.priority_rank, tasks.c.ready_at
)
sa.Index("ix_orc_tasks_state", tasks.c.state, tasks.c.priority_rank, tasks.c.ready_at)
#: admission's round robin across a tenant's runs: the runs with READY tasks of a queue and class,
#: in run id order, each with its oldest first (partial: an entry only while a task is READY)
sa.Index(
    "ix_orc_tasks_ready_runs",
    tasks.c.queue,
    tasks.c.tenant,
    tasks.c.priority_rank,
    tasks.c.run_id,
    tasks.c.ready_at,
    postgresql_where=sa.text("state = 'READY'"),
)

edges = sa.Table(
    "orc_edges",
    metadata,
    sa.Column("run_id", sa.String(32), primary_key=True),
    sa.Column("parent_key", sa.String(200), primary_key=True),
    sa.Column("child_key", sa.String(200), primary_key=True),
)
sa.Index("ix_orc_edges_child", edges.c.run_id, edges.c.child_key)

#: a wide fan-in's arrivals counted over several rows instead of the join's row (issue 35): the
#: join ``key`` of run ``run_id`` has ``quota`` striped parents in ``stripe``; ``arrived`` of them
#: have arrived, and ``pending`` of those succeeded without being counted into the join and the
#: run yet. The arrival that fills the stripe (``arrived = quota``) adds its ``pending`` successes
#: to the join's counters and takes them off the run's open count (``folded``: that last fold's
#: size); a parent that did not succeed is counted into the join at once (it can decide the
#: join's rule early). Written at submit; a clear or a mark counts each stripe again from its
#: parents' states (``orc_redecide_v2``), a retry of a failed parent takes its arrival back
stripes = sa.Table(
    "orc_stripes",
    metadata,
    sa.Column("run_id", sa.String(32), primary_key=True),
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("stripe", sa.SmallInteger, primary_key=True, autoincrement=False),
    sa.Column("quota", sa.Integer, nullable=False),
    sa.Column("arrived", sa.Integer, nullable=False, server_default="0"),
    sa.Column("pending", sa.Integer, nullable=False, server_default="0"),
    sa.Column("folded", sa.Integer, nullable=False, server_default="0"),
)

events = sa.Table(
    "orc_task_events",
    metadata,
    sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(32), nullable=False),
    #: null for a transition of the run itself
    sa.Column("key", sa.String(200), nullable=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("from_state", sa.String(16), nullable=True),
    sa.Column("to_state", sa.String(16), nullable=False),
    sa.Column("actor", sa.String(32), nullable=False),
    #: the person an operator action was taken for (the OS user of the CLI, or the API's ``by``)
    sa.Column("by", sa.String(255), nullable=True),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("accepted", sa.Boolean, nullable=False),
    sa.Column("at", TS, nullable=False),
    #: null for a transition; an annotation (``states.ANNOTATIONS``: a fact recorded about the
    #: task or run without a state change, ``from_state`` = ``to_state``) names its kind here:
    #: ``deadline_missed``
    sa.Column("kind", sa.String(32), nullable=True),
    #: an operator's clear: the result the task held before it (earlier attempts' outcomes stay
    #: in the ledger; the row holds the newest)
    sa.Column("result", sa.JSON, nullable=True),
)
sa.Index("ix_orc_task_events_run", events.c.run_id, events.c.key)
#: annotations by kind and time (partial: transitions, nearly every row, are not in it), so
#: ``kind = 'deadline_missed'`` is counted without reading the ledger
sa.Index(
    "ix_orc_task_events_kind",
    events.c.kind,
    events.c.at,
    postgresql_where=sa.text("kind IS NOT NULL"),
)

#: the idempotency keys of runs ``db clean`` removed (``store/cleanup.py``): a submit with one of
#: them is refused naming the removed run, never a second run; forgotten by ``db clean`` once
#: removed longer ago than its ``--keep-keys`` (default 90 days). A schedule's runs' keys are not
#: kept: a backfill of an instant whose run was removed makes it again.
idempotency_keys = sa.Table(
    "orc_idempotency_keys",
    metadata,
    sa.Column("dag_name", sa.String(200), primary_key=True),
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("idempotency_key", sa.String(200), primary_key=True),
    sa.Column("run_id", sa.String(32), nullable=False),
    #: the removed run's final state and when it was created
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("removed_at", TS, nullable=False),
)
sa.Index("ix_orc_idempotency_keys_removed", idempotency_keys.c.removed_at)
#: ``runs --dag NAME --version N``
sa.Index("ix_orc_runs_dag_version", runs.c.dag_name, runs.c.dag_version, runs.c.created_at)
#: the runs an event trigger started, by state (``orc_triggers``' ``max_active_runs``)
sa.Index("ix_orc_runs_trigger_state", runs.c.tenant, runs.c.trigger, runs.c.state)

#: each running attempt's latest progress (``self.update_state(state=, meta=)`` or
#: ``current_context().progress(...)``): one row per task, overwritten by its attempt (fenced:
#: written only while the task's row holds that attempt RUNNING), removed with its run
progress = sa.Table(
    "orc_progress",
    metadata,
    sa.Column("run_id", sa.String(32), primary_key=True),
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("state", sa.String(64), nullable=False),
    sa.Column("meta", sa.JSON, nullable=True),
    sa.Column("updated_at", TS, nullable=False),
)
