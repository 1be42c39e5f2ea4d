"""The hot path on Postgres: server functions for claim, success (settlement and admission
included) and admission, so each is one round trip (called by orchestrator/store/hotpath.py).
SQLite has no server functions: the store runs the same moves from Python there. A later
change to a function is a new migration with its CREATE OR REPLACE.

Revision ID: 0004
Revises: 0003
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

SQL = r"""
-- The hot path on Postgres: one round trip per transition (orchestrator/store/hotpath.py).
--
-- These functions are the Postgres implementation of the store's hottest moves: the claim
-- (QUEUED -> RUNNING), the success (RUNNING -> SUCCEEDED) with its settlement (children's
-- counters, trigger rules, cascades, closing the run) and admission (READY -> QUEUED within
-- the live workers' capacity). They write exactly what the Python implementation writes
-- (store/ledger.py, settlement.py, admission.py, attempts.py): the same compare-and-sets,
-- the same event rows, the same transitions of states.TRANSITIONS / RUN_TRANSITIONS; the
-- store's contract tests run both. Each function is one statement, so it is atomic in an
-- autocommit session: no BEGIN, no COMMIT, no second round trip.
--
-- Plans: PL/pgSQL caches generic plans, made before the tables have statistics (a new run
-- always is newer than the statistics). A single task is therefore always reached through its
-- primary key: children one at a time by (run, key) (an = ANY(array) or a join on unnest()
-- was planned as a scan of the whole run), and the expected state is compared as coalesce(state, '') so that the state
-- index, full of dead entries during a burst, is never chosen for a one-row compare-and-set.

-- states.decide, as SQL: READY / SKIPPED / UPSTREAM_FAILED once the rule is decided, else NULL
CREATE OR REPLACE FUNCTION orc_decide(rule text, total int, done int, ok int, failed int, skipped int)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
SELECT CASE rule
    WHEN 'all_success' THEN CASE WHEN failed > 0 THEN 'UPSTREAM_FAILED' WHEN skipped > 0 THEN 'SKIPPED'
                                 WHEN done >= total THEN 'READY' END
    WHEN 'all_done' THEN CASE WHEN done >= total THEN 'READY' END
    WHEN 'one_success' THEN CASE WHEN ok > 0 THEN 'READY'
                                 WHEN done >= total THEN
                                     CASE WHEN failed > 0 THEN 'UPSTREAM_FAILED' ELSE 'SKIPPED' END END
    WHEN 'one_failed' THEN CASE WHEN failed > 0 THEN 'READY' WHEN done >= total THEN 'SKIPPED' END
    WHEN 'none_failed' THEN CASE WHEN failed > 0 THEN 'UPSTREAM_FAILED' WHEN done >= total THEN 'READY' END
    WHEN 'all_failed' THEN CASE WHEN ok > 0 OR skipped > 0 THEN 'SKIPPED' WHEN done >= total THEN 'READY' END
END
$$;

-- a rejected event for a task compare-and-set that lost; returns what the row holds (or NULL
-- when there is no such task: nothing is written then)
CREATE OR REPLACE FUNCTION orc_reject(p_run text, p_key text, p_attempt int, p_to text, p_actor text, p_reason text)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    held record;
    holds text;
BEGIN
    SELECT state, attempt INTO held FROM orc_tasks WHERE run_id = p_run AND key = p_key;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    holds := 'row holds ' || held.state || ' attempt ' || held.attempt;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, held.state, p_to, p_actor, NULL,
            CASE WHEN p_reason IS NULL THEN holds ELSE p_reason || '; ' || holds END, false, now());
    RETURN holds;
END
$$;

-- settlement of one task that became terminal: returns how many tasks it closed
CREATE OR REPLACE FUNCTION orc_settle(p_run text, p_key text, p_state text, p_children json, p_actor text, p_by text)
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    q_keys text[] := ARRAY[p_key];
    q_states text[] := ARRAY[p_state];
    q_children json[] := ARRAY[p_children];
    i int := 1;
    closed int := 1;
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
                    IF verdict <> 'READY' THEN
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
    RETURN closed;
END
$$;

-- admission: READY -> QUEUED within the live workers' capacity, in priority order; the
-- dispatches to publish after the caller's commit (see store/admission.py)
CREATE OR REPLACE FUNCTION orc_admit(p_window int, p_worker_ttl float8, p_depth int, p_wait boolean)
RETURNS TABLE (run_id text, key text, attempt int, task_name text, args json, kwargs json, queue text,
               soft_time_limit float8, time_limit float8, priority_rank int, ready_at timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    g record;
    qs text[];
    counts jsonb;
    touched text[] := '{}';
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
    -- one scan for every queue's tasks in flight (QUEUED or RUNNING), not one per group
    SELECT coalesce(jsonb_object_agg(c.queue, c.n), '{}'::jsonb), coalesce(sum(c.n), 0)::int
    INTO counts, total
    FROM (
        SELECT t.queue, count(*) AS n FROM orc_tasks t
        WHERE t.state IN ('QUEUED', 'RUNNING') GROUP BY t.queue
    ) c;
    FOR g IN
        SELECT w.queues::text AS queues, sum(w.concurrency)::int AS capacity
        FROM orc_workers w
        WHERE w.seen_at > now() - make_interval(secs => p_worker_ttl)
        GROUP BY w.queues::text
    LOOP
        qs := ARRAY(SELECT json_array_elements_text(g.queues::json));
        IF qs && touched THEN
            -- an earlier group of this pass admitted into one of these queues: count again
            SELECT count(*)::int INTO used FROM orc_tasks t
            WHERE t.state IN ('QUEUED', 'RUNNING') AND t.queue = ANY(qs);
        ELSE
            SELECT coalesce(sum((counts ->> q)::int), 0)::int INTO used FROM unnest(qs) AS q;
        END IF;
        room := least(g.capacity * p_depth - used, p_window - total);
        CONTINUE WHEN room <= 0;
        RETURN QUERY
        WITH picked AS (
            -- per queue in index order (queue, state, priority_rank, ready_at), then merged: never
            -- a sort of the whole READY backlog
            SELECT x.run_id, x.key
            FROM unnest(qs) AS q(name)
            CROSS JOIN LATERAL (
                SELECT p.run_id, p.key, p.priority_rank, p.ready_at FROM orc_tasks p
                WHERE p.queue = q.name AND p.state = 'READY'
                ORDER BY p.priority_rank, p.ready_at
                LIMIT room
                FOR UPDATE SKIP LOCKED
            ) x
            ORDER BY x.priority_rank, x.ready_at
            LIMIT room
        ), moved AS (
            UPDATE orc_tasks t SET state = 'QUEUED', dispatched_at = now()
            FROM picked
            WHERE t.run_id = picked.run_id AND t.key = picked.key AND t.state = 'READY'
            RETURNING t.run_id::text, t.key::text, t.attempt, t.task_name::text, t.args, t.kwargs, t.queue::text,
                      t.soft_time_limit, t.time_limit, t.priority_rank::int, t.ready_at
        ), events AS (
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            SELECT moved.run_id, moved.key, moved.attempt, 'READY', 'QUEUED', 'dispatcher', NULL, NULL, true, now()
            FROM moved
        )
        SELECT * FROM moved;
        GET DIAGNOSTICS n = ROW_COUNT;
        total := total + n;
        touched := touched || qs;
    END LOOP;
END
$$;

-- the claim: QUEUED -> RUNNING for p_attempt, with the lease deadline; the stored arguments
-- and, for tasks that want them, the results of the parents that succeeded
CREATE OR REPLACE FUNCTION orc_claim(p_run text, p_key text, p_attempt int, p_worker text, p_lease float8)
RETURNS json LANGUAGE plpgsql AS $$
DECLARE
    row record;
    upstream json;
    conflict text;
BEGIN
    UPDATE orc_tasks t SET state = 'RUNNING', started_at = now(), heartbeat_at = now(),
                           lease_expires_at = now() + make_interval(secs => p_lease), worker = p_worker
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'QUEUED' AND t.attempt = p_attempt
    RETURNING t.args, t.kwargs, t.wants_upstream INTO row;
    IF NOT FOUND THEN
        conflict := orc_reject(p_run, p_key, p_attempt, 'RUNNING', 'worker', 'claim by ' || p_worker);
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

-- the success: RUNNING -> SUCCEEDED for p_attempt with its result, settlement, admission
CREATE OR REPLACE FUNCTION orc_succeed(p_run text, p_key text, p_attempt int, p_result json, p_window int,
                                       p_worker_ttl float8, p_depth int)
RETURNS json LANGUAGE plpgsql AS $$
DECLARE
    kids json;
    conflict text;
    dispatches json;
BEGIN
    UPDATE orc_tasks t SET state = 'SUCCEEDED', result = p_result, finished_at = now(), lease_expires_at = NULL
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'RUNNING' AND t.attempt = p_attempt
    RETURNING t.children INTO kids;
    IF NOT FOUND THEN
        conflict := orc_reject(p_run, p_key, p_attempt, 'SUCCEEDED', 'worker', NULL);
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'SUCCEEDED', 'worker', NULL, NULL, true, now());
    PERFORM orc_settle(p_run, p_key, 'SUCCEEDED', kids, 'worker', NULL);
    SELECT coalesce(json_agg(d ORDER BY d.priority_rank, d.ready_at), '[]'::json) INTO dispatches
    FROM orc_admit(p_window, p_worker_ttl, p_depth, true) d;
    RETURN json_build_object('accepted', true, 'dispatches', dispatches);
END
$$;
"""
FUNCTIONS = (
    "orc_succeed(text, text, int, json, int, float8, int)",
    "orc_claim(text, text, int, text, float8)",
    "orc_admit(int, float8, int, boolean)",
    "orc_settle(text, text, text, json, text, text)",
    "orc_reject(text, text, int, text, text, text)",
    "orc_decide(text, int, int, int, int, int)",
)


#: names SQLite's unnamed foreign keys so that batch mode can drop them
_NAMES = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}


def _fk_name(table: str) -> str:
    # Postgres named the keys of revision 0001 itself; SQLite's are unnamed (see _NAMES)
    if op.get_bind().dialect.name == "postgresql":
        return f"{table}_run_id_fkey"
    return f"fk_{table}_run_id_orc_runs"


def upgrade() -> None:
    # submission writes a run and its rows in one transaction: the per-row foreign key checks
    # only slowed its COPY down
    for table in ("orc_tasks", "orc_edges"):
        with op.batch_alter_table(table, naming_convention=_NAMES) as batch:
            batch.drop_constraint(_fk_name(table), type_="foreignkey")
    # admission reads READY rows of a queue in priority order straight from the index
    op.drop_index("ix_orc_tasks_queue_state", "orc_tasks")
    op.create_index("ix_orc_tasks_queue_state", "orc_tasks", ["queue", "state", "priority_rank", "ready_at"])
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(SQL)


def downgrade() -> None:
    for table in ("orc_tasks", "orc_edges"):
        with op.batch_alter_table(table, naming_convention=_NAMES) as batch:
            batch.create_foreign_key(_fk_name(table), "orc_runs", ["run_id"], ["id"])
    op.drop_index("ix_orc_tasks_queue_state", "orc_tasks")
    op.create_index("ix_orc_tasks_queue_state", "orc_tasks", ["queue", "state"])
    if op.get_bind().dialect.name != "postgresql":
        return
    for signature in FUNCTIONS:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
