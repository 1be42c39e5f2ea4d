"""The server functions, versioned: ``orc_<concept>_v1`` from the files of ``store/sql/``.

The live definitions now sit in one folder, one file per concept (``orchestrator/store/sql/``),
named in procrastinate's manner; this revision installs a frozen copy of them. The unversioned
functions of 0004 to 0006 that the previous release calls from Python (``orc_claim``,
``orc_succeed``, ``orc_settle``, ``orc_admit``) become shims over the ``_v1`` ones, so its
workers keep working during a rolling upgrade; the internal ones (``orc_decide``,
``orc_reject``, ``orc_limit_held``, ``orc_admit_from``, ``orc_pass_slot``) are dropped. Admission
now bounds its looks past held picks (``p_room + 1000`` per pass), as the Python admission of
the removed SQLite backend did.

Revision ID: 0009
Revises: 0008
"""

import importlib

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

#: store/sql/ as this revision installs it (frozen: a later change is a later migration)
SQL = r"""
-- orc_decide_v1: a trigger rule's verdict from a task's upstream counters.
--
-- READY, SKIPPED or UPSTREAM_FAILED once the rule is decided by the counters (total upstream,
-- done, succeeded, failed, skipped), NULL while it is not. Called by orc_settle_v1 for each
-- child whose counters a finished parent changed; the only implementation of the trigger rules.

CREATE OR REPLACE FUNCTION orc_decide_v1(rule text, total integer, done integer, ok integer, failed integer,
    skipped integer)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $$
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

-- orc_reject_v1: the conflict ledger's row for a task compare-and-set that lost.
--
-- Writes a rejected event (accepted = false) naming what the row holds, and returns that text
-- ("row holds RUNNING attempt 2"); returns NULL and writes nothing when there is no such task.

CREATE OR REPLACE FUNCTION orc_reject_v1(p_run text, p_key text, p_attempt integer, p_to text, p_actor text,
    p_reason text)
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
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

-- orc_limit_held_v1: what holds back a READY task that admission picked, or NULL.
--
-- 'tenant' (the tenant's max_running), 'run' (the run's max_active_tasks or its DAG's limit),
-- 'pool' (the pool is full or gone), 'slots' (the pool has free slots, fewer than the task
-- asks), 'rate' (no token, or the rate limit is gone). Every count is of the task rows in
-- flight (QUEUED + RUNNING), so a slot frees exactly when its task ends: nothing can leak. A
-- pick that some limit applies to is checked under the admission lock.

CREATE OR REPLACE FUNCTION orc_limit_held_v1(p_run text, p_tenant text, p_tenant_limit integer, p_pool text,
    p_pool_slots integer, p_rate text)
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    run_limit int;
    dag text;
    dag_limit int;
    n int;
    free int;
    tokens float8;
BEGIN
    SELECT r.max_active_tasks, r.dag_name INTO run_limit, dag FROM orc_runs r WHERE r.id = p_run;
    SELECT d.max_running INTO dag_limit FROM orc_dag_limits d WHERE d.tenant = p_tenant AND d.dag_name = dag;
    IF p_tenant_limit IS NULL AND p_pool IS NULL AND p_rate IS NULL AND run_limit IS NULL AND dag_limit IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM pg_advisory_xact_lock(1869767425);
    IF p_tenant_limit IS NOT NULL THEN
        SELECT count(*) INTO n FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
            CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t  WHERE t.state = s.state AND t.tenant = p_tenant
                ORDER BY t.state, t.priority_rank, t.ready_at LIMIT 1000000000) AS i;
        IF n >= p_tenant_limit THEN
            RETURN 'tenant';
        END IF;
    END IF;
    IF run_limit IS NOT NULL THEN
        SELECT count(*) INTO n FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
            CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t  WHERE t.state = s.state AND t.run_id = p_run
                ORDER BY t.state, t.priority_rank, t.ready_at LIMIT 1000000000) AS i;
        IF n >= run_limit THEN
            RETURN 'run';
        END IF;
    END IF;
    IF dag_limit IS NOT NULL THEN
        SELECT count(*) INTO n FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
            CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t JOIN orc_runs r ON r.id = t.run_id
                WHERE t.state = s.state AND r.tenant = p_tenant AND r.dag_name = dag
                    ORDER BY t.state, t.priority_rank, t.ready_at LIMIT 1000000000) AS i;
        IF n >= dag_limit THEN
            RETURN 'run';
        END IF;
    END IF;
    IF p_pool IS NOT NULL THEN
        SELECT p.slots INTO free FROM orc_pools p WHERE p.name = p_pool;
        IF NOT FOUND THEN
            RETURN 'pool';
        END IF;
        SELECT free - coalesce(sum(i.pool_slots), 0) INTO free
            FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
                CROSS JOIN LATERAL (SELECT t.pool_slots FROM orc_tasks t
                    WHERE t.state = s.state AND t.pool = p_pool
                        ORDER BY t.state, t.priority_rank, t.ready_at LIMIT 1000000000) AS i;
        IF free <= 0 THEN
            RETURN 'pool';
        ELSIF free < p_pool_slots THEN
            RETURN 'slots';
        END IF;
    END IF;
    IF p_rate IS NOT NULL THEN
        SELECT least(l.burst, l.tokens + l.rate * greatest(extract(epoch FROM clock_timestamp() - l.refilled_at), 0))
        INTO tokens FROM orc_rate_limits l WHERE l.key = p_rate;
        IF NOT FOUND OR tokens < 1 THEN
            RETURN 'rate';
        END IF;
    END IF;
    RETURN NULL;
END
$$;

-- orc_admit_from_v1: up to p_room READY tasks of p_queues -> QUEUED, one pick at a time.
--
-- Each pick is the best head: of each tenant's READY tasks in each queue the first (priority,
-- then age); among the heads the highest class (a task READY for p_aging seconds counts one
-- class higher, twice as long two), then the tenant furthest below its weighted share of the
-- tasks in flight on these queues, then round robin (last_admitted_at), then the oldest. A pick
-- that a limit holds back (orc_limit_held_v1) is set aside with its tenant, run, pool or rate
-- limit and the next head is looked at: a held pick uses no room, and a pass looks at most
-- p_room + 1000 times (a backlog too big for its pool's free slots is passed over 1,000 at a
-- time per pass, not all of it).

CREATE OR REPLACE FUNCTION orc_admit_from_v1(p_queues text[], p_room integer, p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
#variable_conflict use_column
DECLARE
    loads jsonb;
    pick record;
    skipped text[] := '{}';
    held_runs text[] := '{}';
    held_tenants text[] := '{}';
    held_pools text[] := '{}';
    held_rates text[] := '{}';
    why text;
    taken int := 0;
    looks int := 0;
    n int;
BEGIN
    WHILE taken < p_room AND looks < p_room + 1000 LOOP
        looks := looks + 1;
        WITH RECURSIVE tq(queue, tenant) AS (
            SELECT q.name::text, (SELECT t.tenant::text FROM orc_tasks t WHERE t.queue = q.name AND t.state = 'READY'
                                  ORDER BY t.queue, t.state, t.tenant LIMIT 1)
            FROM unnest(p_queues) AS q(name)
            UNION ALL
            SELECT tq.queue, (SELECT t.tenant::text FROM orc_tasks t WHERE t.queue = tq.queue AND t.state = 'READY'
                                 AND t.tenant > tq.tenant ORDER BY t.queue, t.state, t.tenant LIMIT 1)
            FROM tq WHERE tq.tenant IS NOT NULL
        )
        SELECT h.run_id, h.key, h.tenant, h.pool, h.pool_slots, h.rate_limit, w.max_running AS tenant_limit,
               min(h.tenant) OVER () <> max(h.tenant) OVER () AS contested INTO pick
        FROM tq
        CROSS JOIN LATERAL (
            SELECT p.run_id, p.key, p.tenant, p.priority_rank, p.ready_at, p.pool, p.pool_slots, p.rate_limit
            FROM orc_tasks p
            WHERE p.queue = tq.queue AND p.state = 'READY' AND p.tenant = tq.tenant
              AND NOT ((p.run_id || '/' || p.key) = ANY (skipped))
              AND NOT (p.run_id = ANY (held_runs))
              AND (p.pool IS NULL OR NOT (p.pool = ANY (held_pools)))
              AND (p.rate_limit IS NULL OR NOT (p.rate_limit = ANY (held_rates)))
            ORDER BY p.priority_rank, p.ready_at
            LIMIT 1
        ) AS h
        LEFT JOIN orc_tenants w ON w.name = h.tenant
        WHERE tq.tenant IS NOT NULL AND NOT (tq.tenant = ANY (held_tenants))
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
        why := orc_limit_held_v1(pick.run_id, pick.tenant, pick.tenant_limit, pick.pool, pick.pool_slots,
                                 pick.rate_limit);
        IF why IS NOT NULL THEN
            CASE why
                WHEN 'tenant' THEN held_tenants := held_tenants || pick.tenant::text;
                WHEN 'run' THEN held_runs := held_runs || pick.run_id::text;
                WHEN 'pool' THEN held_pools := held_pools || pick.pool::text;
                WHEN 'rate' THEN held_rates := held_rates || pick.rate_limit::text;
                ELSE skipped := skipped || (pick.run_id || '/' || pick.key);
            END CASE;
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
        IF pick.rate_limit IS NOT NULL THEN
            -- the token (orc_limit_held found one under the admission lock, which is still held)
            UPDATE orc_rate_limits l
            SET tokens = least(l.burst, l.tokens
                               + l.rate * greatest(extract(epoch FROM clock_timestamp() - l.refilled_at), 0)) - 1,
                refilled_at = clock_timestamp()
            WHERE l.key = pick.rate_limit;
        END IF;
        IF loads IS NOT NULL THEN
            loads := jsonb_set(loads, ARRAY[pick.tenant::text],
                               to_jsonb(coalesce((loads ->> pick.tenant)::int, 0) + 1), true);
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

-- orc_pass_slot_v1: a completion that made nothing READY hands its worker's slot on.
--
-- When the worker's group (p_queues, its queues as JSON text) is under its capacity x p_depth,
-- the best READY task of those queues is admitted (orc_admit_from_v1 with room 1), without the
-- admission lock unless a limit applies: no scan of other queues, no waiting behind admissions.

CREATE OR REPLACE FUNCTION orc_pass_slot_v1(p_queues text, p_worker_ttl double precision, p_depth integer,
    p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
#variable_conflict use_column
DECLARE
    qs text[] := ARRAY(SELECT json_array_elements_text(p_queues::json));
    capacity int;
    used int;
BEGIN
    SELECT coalesce(sum(w.concurrency), 0)::int INTO capacity FROM orc_workers w
    WHERE w.queues::text = p_queues AND w.seen_at > now() - make_interval(secs => p_worker_ttl);
    SELECT coalesce(sum((SELECT count(*) FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
        CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t WHERE t.queue = q.name AND t.state = s.state
            ORDER BY t.queue, t.state, t.tenant, t.priority_rank, t.ready_at LIMIT 1000000000) AS i)), 0)::int
                INTO used FROM unnest(qs) AS q(name);
    IF used >= capacity * p_depth THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM orc_admit_from_v1(qs, 1, p_aging);
END
$$;

-- orc_admit_v1: READY -> QUEUED within the live workers' capacity, in fair order.
--
-- Serialized by the admission lock (advisory transaction lock 1869767425): p_wait = true waits
-- for it (a completion, a submit), false returns nothing while another admission holds it (the
-- reconciler). For each group of live workers consuming the same queues, the room is their
-- concurrency x p_depth less the tasks in flight on those queues, and at most p_window tasks
-- are in flight in all; orc_admit_from_v1 fills the room. Returns the rows to publish after
-- the caller commits.

CREATE OR REPLACE FUNCTION orc_admit_v1(p_window integer, p_worker_ttl double precision, p_depth integer,
    p_wait boolean, p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
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
    SELECT coalesce(sum((SELECT count(*) FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
        CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t WHERE t.queue = q.name AND t.state = s.state
            ORDER BY t.queue, t.state, t.tenant, t.priority_rank, t.ready_at LIMIT 1000000000) AS i)), 0)::int
                INTO total
    FROM (SELECT DISTINCT json_array_elements_text(w.queues) AS name FROM orc_workers w
          WHERE w.seen_at > now() - make_interval(secs => p_worker_ttl)) AS q;
    FOR g IN
        SELECT w.queues::text AS queues, sum(w.concurrency)::int AS capacity
        FROM orc_workers w
        WHERE w.seen_at > now() - make_interval(secs => p_worker_ttl)
        GROUP BY w.queues::text
    LOOP
        qs := ARRAY(SELECT json_array_elements_text(g.queues::json));
        SELECT coalesce(sum((SELECT count(*) FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
            CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t WHERE t.queue = q.name AND t.state = s.state
                ORDER BY t.queue, t.state, t.tenant, t.priority_rank, t.ready_at
                    LIMIT 1000000000) AS i)), 0)::int INTO used FROM unnest(qs) AS q(name);
        room := least(g.capacity * p_depth - used, p_window - total);
        CONTINUE WHEN room <= 0;
        RETURN QUERY SELECT * FROM orc_admit_from_v1(qs, room, p_aging);
        GET DIAGNOSTICS n = ROW_COUNT;
        total := total + n;
    END LOOP;
END
$$;

-- orc_settle_v1: a task became terminal; count it into its children and decide them.
--
-- Adds the finished task to each child's counters (one UPDATE ... RETURNING per child, by
-- primary key: never a scan of the run), decides the child's trigger rule (orc_decide_v1),
-- moves decided children PENDING -> READY / SKIPPED / UPSTREAM_FAILED with their ledger rows,
-- cascades the terminal ones the same way, and closes the run (RUNNING -> SUCCEEDED / FAILED)
-- when no task is left open. The actor that caused the first change acts for the cascade.
-- Returns how many tasks it made READY (orc_succeed_v1 passes its slot on when none).

CREATE OR REPLACE FUNCTION orc_settle_v1(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
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
                verdict := orc_decide_v1(r.trigger_rule, r.n_upstream, r.n_done, r.n_succeeded, r.n_failed,
                                         r.n_skipped);
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
                    PERFORM orc_reject_v1(p_run, r.key, r.attempt, verdict, p_actor,
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

-- orc_claim_v1: a worker's claim, QUEUED -> RUNNING for p_attempt, with the lease.
--
-- The attempt is the fencing token and the message's task name must be the node's. Returns
-- {"claimed": true, "args", "kwargs", "wants_upstream", "upstream"} (upstream: the results of
-- the parents that succeeded, for tasks that want them) or {"claimed": false, "conflict"} with
-- the rejected event written (nothing is written for an unknown task).

CREATE OR REPLACE FUNCTION orc_claim_v1(p_run text, p_key text, p_attempt integer, p_worker text,
    p_lease double precision, p_task text)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
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
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'RUNNING', 'worker',
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

-- orc_succeed_v1: RUNNING -> SUCCEEDED for p_attempt with the result, settled and admitted.
--
-- One statement, so one round trip in autocommit: the compare-and-set and its ledger row, the
-- settlement (orc_settle_v1), then either the worker's slot passed on (orc_pass_slot_v1, when
-- nothing became READY and the worker is live) or the whole admission (orc_admit_v1). Returns
-- {"accepted": true, "dispatches": [...]} or {"accepted": false, "conflict"}.

CREATE OR REPLACE FUNCTION orc_succeed_v1(p_run text, p_key text, p_attempt integer, p_result json,
    p_window integer, p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
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
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'SUCCEEDED', 'worker', NULL);
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'SUCCEEDED', 'worker', NULL, NULL, true, now());
    IF orc_settle_v1(p_run, p_key, 'SUCCEEDED', kids, 'worker', NULL) = 0 THEN
        -- the claim recorded the worker as "<worker name>:<pid>"
        SELECT w.queues::text INTO group_queues FROM orc_workers w
        WHERE w.name = regexp_replace(who, ':[0-9]+$', '') AND w.seen_at > now() - make_interval(secs => p_worker_ttl);
        IF FOUND THEN
            SELECT coalesce(json_agg(d), '[]'::json) INTO dispatches
            FROM orc_pass_slot_v1(group_queues, p_worker_ttl, p_depth, p_aging) d;
            RETURN json_build_object('accepted', true, 'dispatches', dispatches);
        END IF;
    END IF;
    SELECT coalesce(json_agg(d ORDER BY d.priority_rank, d.ready_at), '[]'::json) INTO dispatches
    FROM orc_admit_v1(p_window, p_worker_ttl, p_depth, true, p_aging) d;
    RETURN json_build_object('accepted', true, 'dispatches', dispatches);
END
$$;

-- The unversioned names of migrations 0004 to 0006, for workers still running the release
-- before the versioned functions (a rolling upgrade): each is a shim over its _v1 function.
-- Only the four that release called from Python are kept; drop them when no such worker is
-- left (a later migration).

CREATE OR REPLACE FUNCTION orc_claim(p_run text, p_key text, p_attempt integer, p_worker text,
    p_lease double precision, p_task text)
 RETURNS json
 LANGUAGE sql
AS $$
SELECT orc_claim_v1(p_run, p_key, p_attempt, p_worker, p_lease, p_task)
$$;

CREATE OR REPLACE FUNCTION orc_succeed(p_run text, p_key text, p_attempt integer, p_result json, p_window integer,
    p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE sql
AS $$
SELECT orc_succeed_v1(p_run, p_key, p_attempt, p_result, p_window, p_worker_ttl, p_depth, p_aging)
$$;

CREATE OR REPLACE FUNCTION orc_settle(p_run text, p_key text, p_state text, p_children json, p_actor text, p_by text)
 RETURNS integer
 LANGUAGE sql
AS $$
SELECT orc_settle_v1(p_run, p_key, p_state, p_children, p_actor, p_by)
$$;

CREATE OR REPLACE FUNCTION orc_admit(p_window integer, p_worker_ttl double precision, p_depth integer,
    p_wait boolean, p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone)
 LANGUAGE sql
AS $$
SELECT * FROM orc_admit_v1(p_window, p_worker_ttl, p_depth, p_wait, p_aging)
$$;
"""

#: the functions this revision adds
NEW_SIGNATURES = (
    "orc_succeed_v1(text, text, int, json, int, float8, int, float8)",
    "orc_claim_v1(text, text, int, text, float8, text)",
    "orc_settle_v1(text, text, text, json, text, text)",
    "orc_admit_v1(int, float8, int, boolean, float8)",
    "orc_pass_slot_v1(text, float8, int, float8)",
    "orc_admit_from_v1(text[], int, float8)",
    "orc_limit_held_v1(text, text, int, text, int, text)",
    "orc_reject_v1(text, text, int, text, text, text)",
    "orc_decide_v1(text, int, int, int, int, int)",
)

#: 0004 to 0006's internal functions, which only the shims' old bodies called
DROPPED = (
    "orc_pass_slot(text, float8, int, float8)",
    "orc_admit_from(text[], int, float8)",
    "orc_limit_held(text, text, int, text, int, text)",
    "orc_reject(text, text, int, text, text, text)",
    "orc_decide(text, int, int, int, int, int)",
)


def upgrade() -> None:
    op.execute(SQL)
    for signature in DROPPED:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")


def downgrade() -> None:
    # 0004 to 0006's definitions of the unversioned functions (CREATE OR REPLACE; their other
    # statements are idempotent), then the versioned ones go
    for name in ("0004_hot_path", "0005_pass_slot", "0006_limits"):
        op.execute(importlib.import_module(f"orchestrator.store.migrations.versions.{name}").SQL)
    for signature in NEW_SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
