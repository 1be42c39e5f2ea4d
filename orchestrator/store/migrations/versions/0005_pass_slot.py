"""The deployment's signing key (``orc_secrets``), redelivered messages (``orc_deliveries``),
the claim checks the message's task name, and
a completion that made nothing READY passes its worker's slot on (``orc_pass_slot``)
instead of running the whole admission under its lock; admission's UPDATE reaches its rows by
primary key; ``orc_settle`` returns how many tasks it made READY. Postgres only: SQLite runs
the whole admission from Python (one writer at a time there).

Revision ID: 0005
Revises: 0004
"""

import importlib
import secrets

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

#: the tasks of queue ``q.name`` in flight (QUEUED or RUNNING), counted as two index scans in
#: index order: a plain index scan marks the dead entries it meets (autovacuum may be far
#: behind a burst of transitions), so the next count skips them; a bitmap scan of the state
#: index, which the planner chose for ``state IN (...)``, visited every dead entry every time
IN_FLIGHT = (
    "(SELECT count(*) FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state) CROSS JOIN LATERAL"
    " (SELECT 1 FROM orc_tasks t WHERE t.queue = q.name AND t.state = s.state"
    " ORDER BY t.queue, t.state, t.tenant, t.priority_rank, t.ready_at LIMIT 1000000000) AS i)"
)

SQL = r"""
-- Migration 0005: a completion that made nothing READY passes its slot on instead of running
-- admission (orc_pass_slot), and the admission UPDATE reaches its rows by primary key.
--
-- Admission (orc_admit) counts every queue's tasks in flight and takes a lock that every
-- completion waited for: on a 1 -> N -> 1 fan-out that was half of the server's time per task
-- and made the completions queue up behind each other. A completion frees exactly one slot of
-- the worker that ran it; when its settlement made no task READY, nothing else changed for
-- admission, so the slot goes to the best READY task of that worker's queues, if the worker's
-- group is under its window: no lock, no scan of other queues. Every other change of the READY
-- backlog or of the capacity still runs the whole admission (a completion that made tasks READY,
-- a failure, a submit, a worker registering, the reconciler's pass).
--
-- Settlement returns how many tasks it made READY (it returned how many it closed, which no
-- caller read).
--
-- Plans: every hot-path function runs with plan_cache_mode = force_generic_plan. PL/pgSQL
-- otherwise re-plans a statement with parameters on every call whenever the generic plan's
-- estimate looks worse than a custom one (an unnest() of a parameter array is estimated at 10
-- rows, of a constant at 1): planning was most of the cost of a hand-off. The statements are
-- written for generic plans anyway (single tasks by primary key, see 0004).

-- 0004's functions whose signatures change here (new arguments: p_task, p_aging)
DROP FUNCTION IF EXISTS orc_succeed(text, text, int, json, int, float8, int);
DROP FUNCTION IF EXISTS orc_admit(int, float8, int, boolean);

-- the claim: QUEUED -> RUNNING for p_attempt of a task named p_task (the message's task name
-- must be the node's), with the lease deadline; the stored arguments and, for tasks that want
-- them, the results of the parents that succeeded. Replaces 0004's orc_claim without p_task.
DROP FUNCTION IF EXISTS orc_claim(text, text, int, text, float8);
CREATE OR REPLACE FUNCTION orc_claim(p_run text, p_key text, p_attempt int, p_worker text, p_lease float8,
                                     p_task text)
RETURNS json LANGUAGE plpgsql AS $$
DECLARE
    row record;
    upstream json;
    conflict text;
BEGIN
    UPDATE orc_tasks t SET state = 'RUNNING', started_at = now(), heartbeat_at = now(),
                           lease_expires_at = now() + make_interval(secs => p_lease), worker = p_worker
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'QUEUED' AND t.attempt = p_attempt
      AND t.task_name = p_task
    RETURNING t.args, t.kwargs, t.wants_upstream INTO row;
    IF NOT FOUND THEN
        conflict := orc_reject(p_run, p_key, p_attempt, 'RUNNING', 'worker',
                               'claim by ' || p_worker || ' for a message of ' || p_task);
        RETURN json_build_object('claimed', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'QUEUED', 'RUNNING', 'worker', NULL, 'claim by ' || p_worker, true, now());
    IF row.wants_upstream THEN
        SELECT json_object_agg(t.key, t.result) INTO upstream
        FROM orc_edges e JOIN orc_tasks t ON t.run_id = e.run_id AND t.key = e.parent_key
        WHERE e.run_id = p_run AND e.child_key = p_key AND t.state = 'SUCCEEDED';
    END IF;
    RETURN json_build_object('claimed', true, 'args', row.args, 'kwargs', row.kwargs,
                             'wants_upstream', row.wants_upstream, 'upstream', coalesce(upstream, '{}'::json));
END
$$;

-- settlement of one task that became terminal: returns how many tasks it made READY
CREATE OR REPLACE FUNCTION orc_settle(p_run text, p_key text, p_state text, p_children json, p_actor text, p_by text)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    q_keys text[] := ARRAY[p_key];
    q_states text[] := ARRAY[p_state];
    q_children json[] := ARRAY[p_children];
    i int := 1;
    closed int := 1;
    readied int := 0;
    kids text[];
    kid text;
    r record;
    m record;
    verdict text;
    run_row record;
    failed int;
    outcome text;
BEGIN
    WHILE i <= array_length(q_keys, 1) LOOP
        IF q_children[i] IS NOT NULL AND json_typeof(q_children[i]) = 'array' THEN
            kids := ARRAY(SELECT json_array_elements_text(q_children[i]));
            FOREACH kid IN ARRAY kids LOOP
                UPDATE orc_tasks t SET
                    n_done = t.n_done + 1,
                    n_succeeded = t.n_succeeded + (q_states[i] = 'SUCCEEDED')::int,
                    n_failed = t.n_failed + (q_states[i] IN ('FAILED', 'UPSTREAM_FAILED'))::int,
                    n_skipped = t.n_skipped + (q_states[i] = 'SKIPPED')::int
                WHERE t.run_id = p_run AND t.key = kid
                RETURNING t.key, t.state, t.attempt, t.trigger_rule, t.n_upstream, t.n_done, t.n_succeeded,
                          t.n_failed, t.n_skipped INTO r;
                CONTINUE WHEN NOT FOUND OR r.state <> 'PENDING';
                verdict := orc_decide(r.trigger_rule, r.n_upstream, r.n_done, r.n_succeeded, r.n_failed, r.n_skipped);
                CONTINUE WHEN verdict IS NULL;
                UPDATE orc_tasks t SET
                    state = verdict,
                    ready_at = CASE WHEN verdict = 'READY' THEN now() ELSE t.ready_at END,
                    finished_at = CASE WHEN verdict = 'READY' THEN t.finished_at ELSE now() END
                WHERE t.run_id = p_run AND t.key = r.key AND coalesce(t.state, '') = 'PENDING'
                RETURNING t.key, t.attempt, t.children INTO m;
                IF FOUND THEN
                    INSERT INTO orc_task_events
                        (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
                    VALUES (p_run, m.key, m.attempt, 'PENDING', verdict, p_actor, p_by,
                            'upstream ' || q_keys[i] || ' ' || q_states[i], true, now());
                    IF verdict = 'READY' THEN
                        readied := readied + 1;
                    ELSE
                        closed := closed + 1;
                        q_keys := q_keys || m.key;
                        q_states := q_states || verdict;
                        q_children := q_children || m.children;
                    END IF;
                ELSE
                    PERFORM orc_reject(p_run, r.key, r.attempt, verdict, p_actor,
                                       'upstream ' || q_keys[i] || ' ' || q_states[i]);
                END IF;
            END LOOP;
        END IF;
        i := i + 1;
    END LOOP;
    UPDATE orc_runs SET open_tasks = open_tasks - closed WHERE id = p_run RETURNING open_tasks, state INTO run_row;
    IF FOUND AND run_row.open_tasks <= 0 AND run_row.state = 'RUNNING' THEN
        SELECT count(*) INTO failed FROM orc_tasks
        WHERE run_id = p_run AND state IN ('FAILED', 'UPSTREAM_FAILED');
        outcome := CASE WHEN failed > 0 THEN 'FAILED' ELSE 'SUCCEEDED' END;
        UPDATE orc_runs SET state = outcome, finished_at = now() WHERE id = p_run AND state = 'RUNNING';
        IF FOUND THEN
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            VALUES (p_run, NULL, 0, 'RUNNING', outcome, p_actor, p_by,
                    CASE WHEN failed > 0 THEN failed || ' task(s) failed'
                         ELSE 'every task succeeded or was skipped' END,
                    true, now());
        END IF;
    END IF;
    RETURN readied;
END
$$;

-- READY -> QUEUED for at most p_room tasks of the queues p_queues, one at a time, each time the
-- best head: of each tenant's READY tasks in each queue the first (priority, then age), then
-- among those heads the highest class (with aging: one class up per p_aging seconds READY),
-- then the tenant furthest below its share ((tasks in flight + 1) / weight, weights from
-- orc_tenants, default 1), then the tenant served longest ago (round robin: a contested pick
-- stamps orc_tenants.last_admitted_at), then the oldest. So free slots go to the highest class first and,
-- within a class, are shared between the tenants with READY work by weight, however many runs
-- or DAGs each tenant splits its work into. The tenants of a queue are found by a loose index
-- scan over (queue, state, tenant, ...); each pick is moved by primary key.
CREATE OR REPLACE FUNCTION orc_admit_from(p_queues text[], p_room int, p_aging float8)
RETURNS TABLE (run_id text, key text, attempt int, task_name text, args json, kwargs json, queue text,
               soft_time_limit float8, time_limit float8, priority_rank int, ready_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    loads jsonb;
    running jsonb;
    pick record;
    skipped text[] := '{}';
    taken int := 0;
    n int;
BEGIN
    -- tenants with a limit (orchestrator tenant set NAME --max-running N): their tasks in flight
    -- across every queue, counted from the task rows (a slot frees with its task, its lease or
    -- its run's cancel: nothing to leak)
    SELECT jsonb_object_agg(w.name, (
        SELECT count(*) FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
        CROSS JOIN LATERAL (
            SELECT 1 FROM orc_tasks t WHERE t.state = s.state AND t.tenant = w.name
            ORDER BY t.state, t.priority_rank, t.ready_at LIMIT 1000000000
        ) AS i))
    INTO running
    FROM orc_tenants w WHERE w.max_running IS NOT NULL;
    WHILE taken < p_room LOOP
        WITH RECURSIVE tq(queue, tenant) AS (
            SELECT q.name::text, (SELECT t.tenant::text FROM orc_tasks t WHERE t.queue = q.name AND t.state = 'READY'
                                  ORDER BY t.queue, t.state, t.tenant LIMIT 1)
            FROM unnest(p_queues) AS q(name)
            UNION ALL
            SELECT tq.queue, (SELECT t.tenant::text FROM orc_tasks t WHERE t.queue = tq.queue AND t.state = 'READY'
                                 AND t.tenant > tq.tenant ORDER BY t.queue, t.state, t.tenant LIMIT 1)
            FROM tq WHERE tq.tenant IS NOT NULL
        )
        SELECT h.run_id, h.key, h.tenant, min(h.tenant) OVER () <> max(h.tenant) OVER () AS contested INTO pick
        FROM tq
        CROSS JOIN LATERAL (
            SELECT p.run_id, p.key, p.tenant, p.priority_rank, p.ready_at FROM orc_tasks p
            WHERE p.queue = tq.queue AND p.state = 'READY' AND p.tenant = tq.tenant
              AND NOT ((p.run_id || '/' || p.key) = ANY (skipped))
            ORDER BY p.priority_rank, p.ready_at
            LIMIT 1
        ) AS h
        LEFT JOIN orc_tenants w ON w.name = h.tenant
        WHERE tq.tenant IS NOT NULL
          AND (w.max_running IS NULL OR coalesce((running ->> h.tenant)::int, 0) < w.max_running)
        ORDER BY CASE WHEN p_aging > 0
                      THEN greatest(h.priority_rank - floor(extract(epoch FROM now() - h.ready_at) / p_aging)::int, 0)
                      ELSE h.priority_rank END,
                 (coalesce((loads ->> h.tenant)::float8, 0) + 1) / coalesce(w.weight, 1.0),
                 w.last_admitted_at NULLS FIRST,
                 h.ready_at
        LIMIT 1;
        EXIT WHEN NOT FOUND;
        IF pick.contested AND loads IS NULL THEN
            -- tenants compete for the slot: count each one's tasks in flight on these queues
            -- (only then: a single tenant's heads need no share), and pick again
            SELECT coalesce(jsonb_object_agg(f.tenant, f.n), '{}'::jsonb) INTO loads
            FROM (
                SELECT i.tenant, count(*) AS n
                FROM unnest(p_queues) AS q(name)
                CROSS JOIN LATERAL unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
                CROSS JOIN LATERAL (
                    SELECT t.tenant FROM orc_tasks t WHERE t.queue = q.name AND t.state = s.state
                    ORDER BY t.queue, t.state, t.tenant, t.priority_rank, t.ready_at LIMIT 1000000000
                ) AS i
                GROUP BY i.tenant
            ) AS f;
            CONTINUE;
        END IF;
        -- a task a concurrent admission holds is skipped (that tenant's next one is looked at)
        PERFORM 1 FROM orc_tasks t
        WHERE t.run_id = pick.run_id AND t.key = pick.key AND coalesce(t.state, '') = 'READY'
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            skipped := skipped || (pick.run_id || '/' || pick.key);
            CONTINUE;
        END IF;
        RETURN QUERY
        WITH moved AS (
            UPDATE orc_tasks t SET state = 'QUEUED', dispatched_at = now()
            WHERE t.run_id = pick.run_id AND t.key = pick.key AND coalesce(t.state, '') = 'READY'
            RETURNING t.run_id::text, t.key::text, t.attempt, t.task_name::text, t.args, t.kwargs, t.queue::text,
                      t.soft_time_limit, t.time_limit, t.priority_rank::int, t.ready_at
        ), events AS (
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            SELECT moved.run_id, moved.key, moved.attempt, 'READY', 'QUEUED', 'dispatcher', NULL, NULL, true, now()
            FROM moved
        )
        SELECT * FROM moved;
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n = 0 THEN
            skipped := skipped || (pick.run_id || '/' || pick.key);
            CONTINUE;
        END IF;
        taken := taken + 1;
        IF loads IS NOT NULL THEN
            loads := jsonb_set(loads, ARRAY[pick.tenant::text],
                               to_jsonb(coalesce((loads ->> pick.tenant)::int, 0) + 1), true);
        END IF;
        IF running ? pick.tenant THEN
            running := jsonb_set(running, ARRAY[pick.tenant::text],
                                 to_jsonb((running ->> pick.tenant)::int + 1));
        END IF;
        IF pick.contested THEN
            -- round robin between tenants equally far below their share (clock_timestamp():
            -- several picks of one call must differ)
            INSERT INTO orc_tenants (name, weight, updated_at, last_admitted_at)
            VALUES (pick.tenant, 1, now(), clock_timestamp())
            ON CONFLICT (name) DO UPDATE SET last_admitted_at = excluded.last_admitted_at;
        END IF;
    END LOOP;
END
$$;

-- admission: READY -> QUEUED within the live workers' capacity, in priority order; the
-- dispatches to publish after the caller's commit (see store/admission.py)
CREATE OR REPLACE FUNCTION orc_admit(p_window int, p_worker_ttl float8, p_depth int, p_wait boolean,
                                     p_aging float8)
RETURNS TABLE (run_id text, key text, attempt int, task_name text, args json, kwargs json, queue text,
               soft_time_limit float8, time_limit float8, priority_rank int, ready_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    g record;
    qs text[];
    total int;
    used int;
    room int;
    n int;
BEGIN
    PERFORM 1 FROM orc_tasks t WHERE t.state = 'READY' LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- count and admit as one step. A completion or a submit waits for the lock (held for a few
    -- statements that wait on nothing): skipping would leave the work it just made READY to the
    -- next tick when the holder's snapshot predates it. The reconciler does not wait.
    -- 1869767425 = 0x6F726301, the admission lock's key (any constant unlikely to clash)
    IF p_wait THEN
        PERFORM pg_advisory_xact_lock(1869767425);
    ELSIF NOT pg_try_advisory_xact_lock(1869767425) THEN
        RETURN;
    END IF;
    -- the tasks in flight (QUEUED or RUNNING) on the live workers' queues
    SELECT coalesce(sum({in_flight}), 0)::int INTO total
    FROM (SELECT DISTINCT json_array_elements_text(w.queues) AS name FROM orc_workers w
          WHERE w.seen_at > now() - make_interval(secs => p_worker_ttl)) AS q;
    FOR g IN
        SELECT w.queues::text AS queues, sum(w.concurrency)::int AS capacity
        FROM orc_workers w
        WHERE w.seen_at > now() - make_interval(secs => p_worker_ttl)
        GROUP BY w.queues::text
    LOOP
        qs := ARRAY(SELECT json_array_elements_text(g.queues::json));
        SELECT coalesce(sum({in_flight}), 0)::int INTO used FROM unnest(qs) AS q(name);
        room := least(g.capacity * p_depth - used, p_window - total);
        CONTINUE WHEN room <= 0;
        RETURN QUERY SELECT * FROM orc_admit_from(qs, room, p_aging);
        GET DIAGNOSTICS n = ROW_COUNT;
        total := total + n;
    END LOOP;
END
$$;

-- a completing task hands its worker's freed slot on: the best READY task (priority, then
-- age) of the worker's queues, if the worker's group (the live workers consuming the same
-- queues) has fewer than capacity * depth tasks in flight. Concurrent hand-offs each replace
-- their own slot, so they need no lock: the count each one sees includes the other's
-- still-running task.
CREATE OR REPLACE FUNCTION orc_pass_slot(p_queues text, p_worker_ttl float8, p_depth int, p_aging float8)
RETURNS TABLE (run_id text, key text, attempt int, task_name text, args json, kwargs json, queue text,
               soft_time_limit float8, time_limit float8, priority_rank int, ready_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    qs text[] := ARRAY(SELECT json_array_elements_text(p_queues::json));
    capacity int;
    used int;
BEGIN
    SELECT coalesce(sum(w.concurrency), 0)::int INTO capacity FROM orc_workers w
    WHERE w.queues::text = p_queues AND w.seen_at > now() - make_interval(secs => p_worker_ttl);
    SELECT coalesce(sum({in_flight}), 0)::int INTO used FROM unnest(qs) AS q(name);
    IF used >= capacity * p_depth THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM orc_admit_from(qs, 1, p_aging);
END
$$;

-- the success: RUNNING -> SUCCEEDED for p_attempt with its result, settlement, then admission:
-- the freed slot passed on when the settlement made nothing READY and the attempt's worker is
-- live, the whole admission otherwise
CREATE OR REPLACE FUNCTION orc_succeed(p_run text, p_key text, p_attempt int, p_result json, p_window int,
                                       p_worker_ttl float8, p_depth int, p_aging float8)
RETURNS json LANGUAGE plpgsql AS $$
DECLARE
    kids json;
    who text;
    conflict text;
    dispatches json;
    group_queues text;
BEGIN
    UPDATE orc_tasks t SET state = 'SUCCEEDED', result = p_result, finished_at = now(), lease_expires_at = NULL
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'RUNNING' AND t.attempt = p_attempt
    RETURNING t.children, t.worker INTO kids, who;
    IF NOT FOUND THEN
        conflict := orc_reject(p_run, p_key, p_attempt, 'SUCCEEDED', 'worker', NULL);
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'SUCCEEDED', 'worker', NULL, NULL, true, now());
    IF orc_settle(p_run, p_key, 'SUCCEEDED', kids, 'worker', NULL) = 0 THEN
        -- the claim recorded the worker as "<worker name>:<pid>"
        SELECT w.queues::text INTO group_queues FROM orc_workers w
        WHERE w.name = regexp_replace(who, ':[0-9]+$', '') AND w.seen_at > now() - make_interval(secs => p_worker_ttl);
        IF FOUND THEN
            SELECT coalesce(json_agg(d), '[]'::json) INTO dispatches
            FROM orc_pass_slot(group_queues, p_worker_ttl, p_depth, p_aging) d;
            RETURN json_build_object('accepted', true, 'dispatches', dispatches);
        END IF;
    END IF;
    SELECT coalesce(json_agg(d ORDER BY d.priority_rank, d.ready_at), '[]'::json) INTO dispatches
    FROM orc_admit(p_window, p_worker_ttl, p_depth, true, p_aging) d;
    RETURN json_build_object('accepted', true, 'dispatches', dispatches);
END
$$;

ALTER FUNCTION orc_claim(text, text, int, text, float8, text) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION orc_reject(text, text, int, text, text, text) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION orc_settle(text, text, text, json, text, text) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION orc_admit(int, float8, int, boolean, float8) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION orc_admit_from(text[], int, float8) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION orc_pass_slot(text, float8, int, float8) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION orc_succeed(text, text, int, json, int, float8, int, float8) SET plan_cache_mode = force_generic_plan;
""".replace("{in_flight}", IN_FLIGHT)


#: the functions as this revision defines them (dropped on downgrade, before 0004's return)
NEW_SIGNATURES = (
    "orc_succeed(text, text, int, json, int, float8, int, float8)",
    "orc_pass_slot(text, float8, int, float8)",
    "orc_admit(int, float8, int, boolean, float8)",
    "orc_admit_from(text[], int, float8)",
    "orc_claim(text, text, int, text, float8, text)",
)


def upgrade() -> None:
    # the key of the fencing headers' signature (protocol.sign): every process that can read
    # the database can sign and verify; the broker never carries it
    table = op.create_table(
        "orc_secrets",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(256), nullable=False),
    )
    op.bulk_insert(table, [{"name": "signing_key", "value": secrets.token_hex(32)}])
    # redeliveries of broker messages (orchestrator.inbox): a message that keeps killing its pool
    # process is parked after ORCHESTRATOR_MAX_REDELIVERIES deliveries
    op.create_table(
        "orc_deliveries",
        sa.Column("message_id", sa.String(1024), primary_key=True),
        sa.Column("task_name", sa.String(1024), nullable=False),
        sa.Column("deliveries", sa.Integer, nullable=False),
        sa.Column("first_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("parked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("evidence", sa.JSON, nullable=True),
    )
    # tenants' weights in the fair share of admission (orchestrator tenant set NAME --weight W)
    op.create_table(
        "orc_tenants",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("weight", sa.Float, nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_admitted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("max_running", sa.Integer, nullable=True),
        sa.Column("dedicated", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    # admission finds each tenant's first READY task of a queue in index order
    op.drop_index("ix_orc_tasks_queue_state", "orc_tasks")
    op.create_index("ix_orc_tasks_queue_state", "orc_tasks", ["queue", "state", "tenant", "priority_rank", "ready_at"])
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(SQL)


def downgrade() -> None:
    op.drop_index("ix_orc_tasks_queue_state", "orc_tasks")
    op.create_index("ix_orc_tasks_queue_state", "orc_tasks", ["queue", "state", "priority_rank", "ready_at"])
    op.drop_table("orc_tenants")
    op.drop_table("orc_deliveries")
    op.drop_table("orc_secrets")
    if op.get_bind().dialect.name != "postgresql":
        return
    for signature in NEW_SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    # 0004's definitions of orc_settle, orc_admit and orc_succeed (CREATE OR REPLACE)
    previous = importlib.import_module("orchestrator.store.migrations.versions.0004_hot_path")
    op.execute(previous.SQL)
    for signature in previous.FUNCTIONS:
        op.execute(f"ALTER FUNCTION {signature} RESET plan_cache_mode")
