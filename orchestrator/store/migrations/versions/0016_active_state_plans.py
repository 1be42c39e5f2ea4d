"""Plans that stay on the indexes however big the history: the admission's counts of the tasks in
flight (``orc_admit_v1``, ``orc_admit_from_v1``, ``orc_pass_slot_v1``, ``orc_limit_held_v1``)
name the states they count as literals beside the joined state (``t.state IN ('QUEUED',
'RUNNING')``). Their generic plans used to estimate ``t.state = s.state`` from the column's
statistics: once ANALYZE saw a table of finished tasks (autovacuum does, in any deployment with a
history), the estimate was every row and each completion's count became a sequential scan of
``orc_tasks`` (a fan-out beside 24,000 old tasks: 320 -> 41 tasks/s, ``bench/clean.py``). What
the functions return is unchanged.

Revision ID: 0016
Revises: 0015
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(SQL)


def downgrade() -> None:
    op.execute(OLD_SQL)


#: store/sql/limit_held.sql, admit_from.sql, pass_slot.sql and admit.sql as this revision installs
#: them (frozen: a later change is a later migration)
SQL = r"""
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
            CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t  WHERE t.state = s.state
                AND t.state IN ('QUEUED', 'RUNNING') AND t.tenant = p_tenant
                ORDER BY t.state, t.priority_rank, t.ready_at LIMIT 1000000000) AS i;
        IF n >= p_tenant_limit THEN
            RETURN 'tenant';
        END IF;
    END IF;
    IF run_limit IS NOT NULL THEN
        SELECT count(*) INTO n FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
            CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t  WHERE t.state = s.state
                AND t.state IN ('QUEUED', 'RUNNING') AND t.run_id = p_run
                ORDER BY t.state, t.priority_rank, t.ready_at LIMIT 1000000000) AS i;
        IF n >= run_limit THEN
            RETURN 'run';
        END IF;
    END IF;
    IF dag_limit IS NOT NULL THEN
        SELECT count(*) INTO n FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
            CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t JOIN orc_runs r ON r.id = t.run_id
                WHERE t.state = s.state
                    AND t.state IN ('QUEUED', 'RUNNING') AND r.tenant = p_tenant AND r.dag_name = dag
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
                    WHERE t.state = s.state AND t.state IN ('QUEUED', 'RUNNING') AND t.pool = p_pool
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
                        AND t.state IN ('QUEUED', 'RUNNING')
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
            AND t.state IN ('QUEUED', 'RUNNING')
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
            AND t.state IN ('QUEUED', 'RUNNING')
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
                AND t.state IN ('QUEUED', 'RUNNING')
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
"""

#: the same files as 0009 installed them (what a downgrade puts back)
OLD_SQL = r"""
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
"""
