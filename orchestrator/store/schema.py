"""The database schema (SQLAlchemy Core). Alembic migrations must produce exactly this."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

metadata = sa.MetaData()

TS = sa.DateTime(timezone=True)

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

edges = sa.Table(
    "orc_edges",
    metadata,
    sa.Column("run_id", sa.String(32), primary_key=True),
    sa.Column("parent_key", sa.String(200), primary_key=True),
    sa.Column("child_key", sa.String(200), primary_key=True),
)
sa.Index("ix_orc_edges_child", edges.c.run_id, edges.c.child_key)

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

#: live Celery workers and what they can take: the dispatch window is their free capacity
workers = sa.Table(
    "orc_workers",
    metadata,
    sa.Column("name", sa.String(255), primary_key=True),
    sa.Column("queues", sa.JSON, nullable=False),
    sa.Column("concurrency", sa.Integer, nullable=False),
    sa.Column("started_at", TS, nullable=False),
    sa.Column("seen_at", TS, nullable=False),
)

#: the task names each live worker registered, per queue it consumes (``task_name`` ``*``: a
#: worker that does not say, which takes every name): admission holds a READY task whose
#: (queue, task name) no row has (``orc_admit_from_v2``); a worker's rows go with its registry row
worker_tasks = sa.Table(
    "orc_worker_tasks",
    metadata,
    sa.Column("queue", sa.String(200), primary_key=True),
    sa.Column("task_name", sa.String(255), primary_key=True),
    sa.Column("worker", sa.String(255), primary_key=True),
)

secrets = sa.Table(
    "orc_secrets",
    metadata,
    #: ``signing_key``: the key of the fencing headers' signature (``protocol.sign``), made by
    #: migration 0005; every process that can reach the database reads it, the broker never sees it
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(256), nullable=False),
)

deliveries = sa.Table(
    "orc_deliveries",
    metadata,
    #: redeliveries of one broker message (kept only for messages delivered again: a message
    #: whose pool process died comes back flagged ``redelivered``); past
    #: ``ORCHESTRATOR_MAX_REDELIVERIES`` it is parked (``inbox.GuardedConsumer``)
    sa.Column("message_id", sa.String(1024), primary_key=True),
    sa.Column("task_name", sa.String(1024), nullable=False),
    sa.Column("deliveries", sa.Integer, nullable=False),
    sa.Column("first_at", TS, nullable=False),
    sa.Column("last_at", TS, nullable=False),
    #: set when the message was parked, with the evidence (headers, body head, reason)
    sa.Column("parked_at", TS, nullable=True),
    sa.Column("evidence", sa.JSON, nullable=True),
)

tenants = sa.Table(
    "orc_tenants",
    metadata,
    #: a tenant's weight in the fair share of admission (default 1 for a tenant with no row)
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("weight", sa.Float, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    #: when admission last gave this tenant a slot another tenant also wanted: between tenants
    #: equally far below their share, the one served longest ago goes next (round robin)
    sa.Column("last_admitted_at", TS, nullable=True),
    #: most tasks of this tenant QUEUED or RUNNING at once, across every queue (null: no limit)
    sa.Column("max_running", sa.Integer, nullable=True),
    #: the tenant's tasks go to its own queues (orchestrator.tenant.<name>.<priority>), served by
    #: workers started with `orchestrator worker --tenant <name>`
    sa.Column("dedicated", sa.Boolean, nullable=False, server_default=sa.false()),
)

pools = sa.Table(
    "orc_pools",
    metadata,
    #: a named pool of slots (``orchestrator pool set NAME --slots N``): the tasks that name it hold
    #: ``pool_slots`` each while QUEUED or RUNNING, counted from the task rows at admission
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("slots", sa.Integer, nullable=False),
    sa.Column("description", sa.Text, nullable=True),
    sa.Column("updated_at", TS, nullable=False),
)

rate_limits = sa.Table(
    "orc_rate_limits",
    metadata,
    #: a token bucket for the whole deployment (``orchestrator limit set KEY --rate 10/s``): each
    #: admission of a task naming it takes a token; ``rate`` tokens per second refill it up to ``burst``
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("rate", sa.Float, nullable=False),
    sa.Column("burst", sa.Integer, nullable=False),
    #: tokens left at ``refilled_at`` (the refill since then is computed when a token is taken)
    sa.Column("tokens", sa.Float, nullable=False),
    sa.Column("refilled_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)

dag_limits = sa.Table(
    "orc_dag_limits",
    metadata,
    #: most tasks QUEUED or RUNNING at once across every run of one tenant's DAG
    #: (``orchestrator --tenant T dag set NAME --max-running N``)
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("dag_name", sa.String(200), primary_key=True),
    sa.Column("max_running", sa.Integer, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)

breakers = sa.Table(
    "orc_breakers",
    metadata,
    #: a circuit breaker per resource (``orchestrator breaker set NAME``): ``mode`` on (counts and
    #: holds), metrics (counts, never holds) or disabled; ``state`` closed, open or half_open
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("mode", sa.String(16), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    #: opened by an operator: stays open until ``breaker close``
    sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()),
    #: the trip rule over the last ``window_seconds``: calls >= min_calls, failures >= min_failures
    #: and failures / calls >= failure_rate
    sa.Column("window_seconds", sa.Float, nullable=False),
    sa.Column("min_calls", sa.Integer, nullable=False),
    sa.Column("min_failures", sa.Integer, nullable=False),
    sa.Column("failure_rate", sa.Float, nullable=False),
    #: exception class names counted as the resource's failures besides time-outs and connection errors
    sa.Column("failure_on", postgresql.ARRAY(sa.Text), nullable=True),
    #: how long it stays open: open_min at the first trip, doubled per consecutive re-open up to open_max
    sa.Column("open_min", sa.Float, nullable=False),
    sa.Column("open_max", sa.Float, nullable=False),
    #: half-open: how many probe permits, and each probe's lease
    sa.Column("probes", sa.Integer, nullable=False),
    sa.Column("probe_lease", sa.Float, nullable=False),
    #: after closing, waves of 1, 2, 4 ... tasks up to ramp_max (1: no ramp)
    sa.Column("ramp_max", sa.Integer, nullable=False),
    sa.Column("open_for", sa.Float, nullable=True),
    sa.Column("open_until", TS, nullable=True),
    sa.Column("reopens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("probes_left", sa.Integer, nullable=False, server_default="0"),
    #: the ramp's wave in progress (null: not ramping), tasks admitted and succeeded in it
    sa.Column("wave", sa.Integer, nullable=True),
    sa.Column("wave_admitted", sa.Integer, nullable=False, server_default="0"),
    sa.Column("wave_done", sa.Integer, nullable=False, server_default="0"),
    sa.Column("wave_at", TS, nullable=True),
    sa.Column("changed_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)

breaker_counts = sa.Table(
    "orc_breaker_counts",
    metadata,
    #: a breaker's calls and failures per second (its sliding window sums the last window_seconds)
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("second", TS, primary_key=True),
    sa.Column("calls", sa.Integer, nullable=False),
    sa.Column("failures", sa.Integer, nullable=False),
)

breaker_probes = sa.Table(
    "orc_breaker_probes",
    metadata,
    #: a half-open breaker's probe permit handed to a task attempt, until lease_until (a probe
    #: that outlives it counts as a failure)
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("run_id", sa.String(32), primary_key=True),
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("attempt", sa.Integer, primary_key=True),
    sa.Column("lease_until", TS, nullable=False),
)

breaker_events = sa.Table(
    "orc_breaker_events",
    metadata,
    #: every state change of a breaker and every operator action on it, with who acted; alerted_at:
    #: when the reconciler posted its alert and counted its metric
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(64), nullable=False),
    sa.Column("from_state", sa.String(16), nullable=True),
    sa.Column("to_state", sa.String(16), nullable=False),
    sa.Column("actor", sa.String(32), nullable=False),
    sa.Column("by", sa.String(255), nullable=True),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("at", TS, nullable=False),
    sa.Column("alerted_at", TS, nullable=True),
)
sa.Index("ix_orc_breaker_events_name", breaker_events.c.name, breaker_events.c.id)
sa.Index("ix_orc_breaker_events_unalerted", breaker_events.c.id, postgresql_where=sa.text("alerted_at IS NULL"))

schedules = sa.Table(
    "orc_schedules",
    metadata,
    #: a schedule fires runs of a DAG at the instants of its cron expression (in its zone, with
    #: its DST policy) or every ``every_seconds`` (``orchestrator schedule add``; orchestrator.schedules);
    #: names are unique per tenant (key: tenant, name)
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("cron", sa.String(200), nullable=True),
    sa.Column("every_seconds", sa.Float, nullable=True),
    sa.Column("timezone", sa.String(64), nullable=False),
    sa.Column("dst_gap", sa.String(8), nullable=False),
    sa.Column("dst_fold", sa.String(8), nullable=False),
    sa.Column("catchup", sa.String(8), nullable=False),
    sa.Column("max_catchup", sa.Integer, nullable=False),
    sa.Column("overlap", sa.String(16), nullable=False),
    sa.Column("max_active_runs", sa.Integer, nullable=True),
    #: what it runs: a spec snapshotted at add/apply (with its content hash), or a factory
    #: ``module:function(logical_date, params) -> DAG``
    sa.Column("spec", sa.JSON, nullable=True),
    sa.Column("spec_hash", sa.String(64), nullable=True),
    sa.Column("factory", sa.String(255), nullable=True),
    #: or a DAG of the registry (``orc_dags``, the schedule's tenant's), at ``registered_version``
    #: or, when that is null, at its latest version when the schedule fires
    sa.Column("registered", sa.String(200), nullable=True),
    sa.Column("registered_version", sa.Integer, nullable=True),
    sa.Column("params", sa.JSON, nullable=False),
    sa.Column("paused", sa.Boolean, nullable=False),
    #: the next instant to look at (UTC; due when the database clock passes it)
    sa.Column("next_at", TS, nullable=False),
    #: the last instant decided (fired or recorded as skipped)
    sa.Column("last_at", TS, nullable=True),
    #: overlap=buffer_one: the instant waiting for the previous run to end
    sa.Column("buffered_at", TS, nullable=True),
    sa.Column("last_run_id", sa.String(32), nullable=True),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("last_error_at", TS, nullable=True),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)
sa.Index("ix_orc_schedules_due", schedules.c.paused, schedules.c.next_at)

firings = sa.Table(
    "orc_schedule_firings",
    metadata,
    #: every instant of a schedule that was decided: ``pending`` (a run is being created),
    #: ``fired`` (``run_id``), ``skipped`` (``reason``: missed, overlap, ...) or ``failed``;
    #: of the schedule (``tenant``, ``schedule``)
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("schedule", sa.String(200), primary_key=True),
    sa.Column("logical_date", TS, primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    #: scheduled, catchup, buffered, backfill or manual
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("run_id", sa.String(32), nullable=True),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("at", TS, nullable=False),
    #: a registered DAG's schedule: the version the firing ran
    sa.Column("dag_version", sa.Integer, nullable=True),
)

dags = sa.Table(
    "orc_dags",
    metadata,
    #: the DAG registry (``orchestrator dag register``, ``Orchestrator.register``): a DAG's name
    #: per tenant, its newest version, and whether schedules (and events) may start runs of it
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("latest_version", sa.Integer, nullable=False),
    #: ``orchestrator dag pause``: schedules and events start no run (a submit by hand does)
    sa.Column("paused", sa.Boolean, nullable=False),
    sa.Column("paused_at", TS, nullable=True),
    sa.Column("paused_by", sa.String(255), nullable=True),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)

dag_versions = sa.Table(
    "orc_dag_versions",
    metadata,
    #: each version of a registered DAG: its definition (the spec without its tenant) and the
    #: SHA-256 of it; a new version only when the definition differs from the latest
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("content_hash", sa.String(64), nullable=False),
    sa.Column("spec", sa.JSON, nullable=False),
    sa.Column("registered_at", TS, nullable=False),
    sa.Column("registered_by", sa.String(255), nullable=True),
    sa.ForeignKeyConstraint(
        ["tenant", "name"], ["orc_dags.tenant", "orc_dags.name"], name="fk_orc_dag_versions_dag", ondelete="CASCADE"
    ),
)
#: "which version has this content" (a submit of a spec that is registered; register's check)
sa.Index("ix_orc_dag_versions_hash", dag_versions.c.tenant, dag_versions.c.name, dag_versions.c.content_hash)
#: ``runs --dag NAME --version N``
sa.Index("ix_orc_runs_dag_version", runs.c.dag_name, runs.c.dag_version, runs.c.created_at)

emitted = sa.Table(
    "orc_events",
    metadata,
    #: an event (``orchestrator.emit``, ``orchestrator emit``, ``POST /api/events``) or a signal
    #: to one run (``run.signal``: ``run_id`` set): matched against the waits in the transaction
    #: that writes it, kept for the lookback of waits that begin after it and for de-duplication
    #: by ``event_id`` per tenant
    sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("event_id", sa.String(200), nullable=False),
    sa.Column("payload", postgresql.JSONB, nullable=False),
    sa.Column("run_id", sa.String(32), nullable=True),
    sa.Column("emitted_at", TS, nullable=False),
    sa.Column("by", sa.String(255), nullable=True),
    #: how many waiting tasks it woke when it was written
    sa.Column("woke", sa.Integer, nullable=False, server_default="0"),
    sa.UniqueConstraint("tenant", "event_id", name="uq_orc_events_event_id"),
)
#: a wait that begins looks back for its event (tenant, key, newest first)
sa.Index("ix_orc_events_key", emitted.c.tenant, emitted.c.key, emitted.c.emitted_at)
#: pruning by age
sa.Index("ix_orc_events_emitted", emitted.c.emitted_at)
sa.Index("ix_orc_runs_trigger_state", runs.c.tenant, runs.c.trigger, runs.c.state)

triggers = sa.Table(
    "orc_triggers",
    metadata,
    #: an event trigger (``orchestrator on add NAME --event KEY``): each event of ``event_key``
    #: (of its tenant) whose payload contains ``match`` starts one run of what it names (a spec
    #: snapshot, a factory or a registered DAG, as a schedule does), the payload laid over its
    #: params; at most ``max_active_runs`` running at once (the others wait their turn)
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("event_key", sa.String(200), nullable=False),
    sa.Column("match", postgresql.JSONB, nullable=True),
    sa.Column("spec", sa.JSON, nullable=True),
    sa.Column("spec_hash", sa.String(64), nullable=True),
    sa.Column("factory", sa.String(255), nullable=True),
    sa.Column("registered", sa.String(200), nullable=True),
    sa.Column("registered_version", sa.Integer, nullable=True),
    sa.Column("params", sa.JSON, nullable=False),
    sa.Column("max_active_runs", sa.Integer, nullable=True),
    sa.Column("paused", sa.Boolean, nullable=False),
    sa.Column("last_error", sa.Text, nullable=True),
    sa.Column("last_error_at", TS, nullable=True),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
)
sa.Index("ix_orc_triggers_event", triggers.c.tenant, triggers.c.event_key)

trigger_firings = sa.Table(
    "orc_trigger_firings",
    metadata,
    #: one row per (trigger, event): written with the event (``pending``), then ``fired`` with
    #: its run, ``waiting`` (the trigger is at max_active_runs: it runs when one ends),
    #: ``skipped`` (paused) or ``failed``; whoever finds it pending finishes it (the emitter,
    #: any beat, any serve), the run's idempotency key making it one run
    sa.Column("tenant", sa.String(64), primary_key=True),
    sa.Column("trigger", sa.String(200), primary_key=True),
    sa.Column("event", sa.BigInteger, primary_key=True),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("run_id", sa.String(32), nullable=True),
    sa.Column("reason", sa.Text, nullable=True),
    sa.Column("dag_version", sa.Integer, nullable=True),
    sa.Column("at", TS, nullable=False),
)
sa.Index(
    "ix_orc_trigger_firings_open",
    trigger_firings.c.state,
    trigger_firings.c.at,
    postgresql_where=sa.text("state IN ('pending', 'waiting')"),
)
