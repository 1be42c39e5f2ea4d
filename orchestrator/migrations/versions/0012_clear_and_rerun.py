"""Clear and re-run: ``orc_clear_v1`` (an operator's clear: tasks back to PENDING with attempt + 1,
a running attempt fenced), ``orc_mark_v1`` (an outcome set by hand) and ``orc_redecide_v1`` (the
counters counted again from the parents' states, the run reopened, the tasks decided again); the
ledger's ``result`` (the outcome a clear took back) and a run's ``rerun_of``.

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

NEW_SIGNATURES = (
    "orc_clear_v1(text, text[], text, text, text)",
    "orc_mark_v1(text, text, text, text, text)",
    "orc_redecide_v1(text, text[], text, text, text)",
)


def upgrade() -> None:
    op.add_column("orc_task_events", sa.Column("result", sa.JSON, nullable=True))
    op.add_column("orc_runs", sa.Column("rerun_of", sa.String(32), nullable=True))
    op.execute(SQL)


def downgrade() -> None:
    for signature in NEW_SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.drop_column("orc_runs", "rerun_of")
    op.drop_column("orc_task_events", "result")


#: store/sql/ as this revision installs it (frozen: a later change is a later migration)
SQL = r"""
-- orc_decide_v2: a trigger rule's verdict from a task's upstream counters (Airflow's 13 rules).
--
-- READY, SKIPPED or UPSTREAM_FAILED once the rule is decided, NULL while it is not. The counters
-- are those of the task's relevant upstream (a mapped parent counts once per child): total,
-- done, succeeded, failed (FAILED), upstream_failed, skipped, and of them the setup tasks (total
-- setups, succeeded, skipped). A verdict reached while done < total is an early verdict.
-- p_ratio (0 < r <= 1, all_success only): READY once done = total and at least
-- ceil(r x total) succeeded; decided early once that many can no longer succeed.
-- Called by orc_settle_v2 for each child whose counters a finished parent changed; the only
-- implementation of the trigger rules (``always`` is READY at submit and never asks).
-- The Python statement of the same table is tests/store/test_trigger_rules.py's.

CREATE OR REPLACE FUNCTION orc_decide_v2(rule text, total integer, done integer, ok integer, failed integer,
    upstream_failed integer, skipped integer, setups integer, setup_ok integer, setup_skipped integer,
    p_ratio double precision)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $$
SELECT CASE
    WHEN p_ratio IS NOT NULL AND rule = 'all_success' THEN
        CASE WHEN done >= total AND ok >= ceil(p_ratio * total) THEN 'READY'
             WHEN total - (failed + upstream_failed + skipped) < ceil(p_ratio * total) THEN
                 CASE WHEN failed + upstream_failed > 0 THEN 'UPSTREAM_FAILED' ELSE 'SKIPPED' END END
    ELSE CASE rule
    WHEN 'all_success' THEN CASE WHEN failed + upstream_failed > 0 THEN 'UPSTREAM_FAILED'
                                 WHEN skipped > 0 THEN 'SKIPPED'
                                 WHEN ok >= total THEN 'READY' END
    WHEN 'all_failed' THEN CASE WHEN ok + skipped > 0 THEN 'SKIPPED'
                                WHEN failed + upstream_failed >= total THEN 'READY' END
    WHEN 'all_done' THEN CASE WHEN done >= total THEN 'READY' END
    WHEN 'all_skipped' THEN CASE WHEN ok + failed + upstream_failed > 0 THEN 'SKIPPED'
                                 WHEN skipped >= total THEN 'READY' END
    WHEN 'one_success' THEN CASE WHEN ok > 0 THEN 'READY'
                                 WHEN done >= total AND done = skipped THEN 'SKIPPED'
                                 WHEN done >= total THEN 'UPSTREAM_FAILED' END
    WHEN 'one_failed' THEN CASE WHEN failed + upstream_failed > 0 THEN 'READY'
                                WHEN done >= total THEN 'SKIPPED' END
    WHEN 'one_done' THEN CASE WHEN ok + failed > 0 THEN 'READY'
                              WHEN done >= total THEN 'SKIPPED' END
    WHEN 'none_failed' THEN CASE WHEN failed + upstream_failed > 0 THEN 'UPSTREAM_FAILED'
                                 WHEN ok + skipped >= total THEN 'READY' END
    WHEN 'none_failed_min_one_success' THEN
        CASE WHEN failed + upstream_failed > 0 THEN 'UPSTREAM_FAILED'
             WHEN skipped >= total THEN 'SKIPPED'
             WHEN ok + skipped >= total THEN 'READY' END
    WHEN 'none_skipped' THEN CASE WHEN skipped > 0 THEN 'SKIPPED'
                                  WHEN done >= total THEN 'READY' END
    WHEN 'all_done_min_one_success' THEN
        CASE WHEN skipped > 0 THEN 'SKIPPED'
             WHEN done >= total AND ok > 0 THEN 'READY'
             WHEN done >= total THEN 'UPSTREAM_FAILED' END
    WHEN 'all_done_setup_success' THEN
        CASE WHEN done < total THEN NULL
             WHEN setups > 0 AND setup_skipped >= setups THEN 'SKIPPED'
             WHEN setups > 0 AND setup_ok = 0 THEN 'UPSTREAM_FAILED'
             ELSE 'READY' END
    WHEN 'always' THEN 'READY'
    END
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

-- orc_expand_v1: a mapped node whose trigger rule says READY becomes its children.
--
-- The items come from the node's map spec (orc_tasks.map_spec): each mapped argument is a
-- parent's JSON result (a list: keys are indexes; an object: keys are its keys and items its
-- values; with "map_key", each item's own field) or a literal list; several arguments are
-- zipped (equal lengths) or crossed ("product"). The children, "<key>[<map key>]", are
-- inserted by one INSERT ... SELECT with the node's options and constant kwargs plus the
-- item as the mapped keyword (a map wider than its window, map_spec "window": the first window,
-- the rest later by orc_map_window_v1): READY (the first "max_active" of them when that is set, the
-- rest PENDING until a sibling finishes), with their ledger rows. A node mapped item by item
-- over this one (a chained map) is expanded at once with the same keys, each child PENDING on
-- its item. The mapped node itself moves PENDING -> MAPPED, each downstream node counts one
-- upstream per child, and the run's task counts grow. No items: the node ends SKIPPED
-- (on_empty "skip", reason empty_map) or SUCCEEDED with [] ("success"). A parent that did not
-- succeed: SKIPPED when it was skipped, else UPSTREAM_FAILED. Items that cannot map (not a list
-- or object, past max_length, zip lengths that differ, a key that is not a valid map key or is
-- repeated): FAILED with a MapError, and the run fails with it. Returns {"state", "readied",
-- "children"} (children: the node's downstream keys, for the caller's cascade when the state
-- is terminal), or NULL when the node is no longer PENDING.

CREATE OR REPLACE FUNCTION orc_map_items_v1(p_value json, p_key_field text)
 RETURNS jsonb
 LANGUAGE sql
 IMMUTABLE
AS $$
SELECT CASE json_typeof(p_value)
    WHEN 'array' THEN (
        SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'k', CASE WHEN p_key_field IS NULL THEN (e.o - 1)::text ELSE e.v::jsonb ->> p_key_field END,
                   'v', e.v) ORDER BY e.o), '[]'::jsonb)
        FROM json_array_elements(p_value) WITH ORDINALITY AS e(v, o))
    WHEN 'object' THEN (
        SELECT coalesce(jsonb_agg(jsonb_build_object('k', e.k, 'v', e.v) ORDER BY e.o), '[]'::jsonb)
        FROM json_each(p_value) WITH ORDINALITY AS e(k, v, o))
END
$$;

CREATE OR REPLACE FUNCTION orc_expand_v1(p_run text, p_key text, p_actor text, p_by text, p_why text)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    h record;
    arg json;
    src record;
    list jsonb;
    acc jsonb;
    n int;
    problem text;
    outcome text;
    combine text;
    readied int;
    win int;
BEGIN
    SELECT t.map_spec, t.children, t.state, t.attempt INTO h FROM orc_tasks t
    WHERE t.run_id = p_run AND t.key = p_key FOR UPDATE;
    IF NOT FOUND OR h.state <> 'PENDING' THEN
        RETURN NULL;
    END IF;
    combine := coalesce(h.map_spec->>'combine', 'zip');
    FOR arg IN SELECT a FROM json_array_elements(h.map_spec->'args') AS a LOOP
        IF arg->>'from' IS NULL THEN
            list := orc_map_items_v1(arg->'items', h.map_spec->>'map_key');
        ELSE
            SELECT t.state, t.result, t.map_spec IS NOT NULL AS mapped INTO src FROM orc_tasks t
            WHERE t.run_id = p_run AND t.key = arg->>'from';
            IF src.state IS DISTINCT FROM 'SUCCEEDED' THEN
                outcome := CASE WHEN src.state = 'SKIPPED' THEN 'SKIPPED' ELSE 'UPSTREAM_FAILED' END;
                problem := 'the mapped parent ' || (arg->>'from') || ' is ' || coalesce(src.state, 'missing');
                EXIT;
            END IF;
            IF src.mapped THEN
                -- the parent is a map that ended (on_empty, or after its children): its items are
                -- its children's results in map order
                SELECT coalesce(jsonb_agg(jsonb_build_object('k', c.map_key, 'v', c.result) ORDER BY c.map_index),
                                '[]'::jsonb) INTO list
                FROM orc_tasks c WHERE c.run_id = p_run AND c.map_parent = arg->>'from' AND c.state = 'SUCCEEDED';
            ELSE
                list := orc_map_items_v1(src.result, h.map_spec->>'map_key');
            END IF;
        END IF;
        IF list IS NULL THEN
            outcome := 'FAILED';
            problem := 'MapError: ' || coalesce(arg->>'from', 'the literal items') || ' is not a JSON list or object';
            EXIT;
        END IF;
        IF acc IS NULL THEN
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object('k', l.x->'k', 'kw',
                                      jsonb_build_object(arg->>'kwarg', l.x->'v')) ORDER BY l.o), '[]'::jsonb)
                    FROM jsonb_array_elements(list) WITH ORDINALITY AS l(x, o));
        ELSIF combine = 'product' THEN
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                      'k', to_jsonb((a.x->>'k') || ',' || (l.x->>'k')),
                                      'kw', (a.x->'kw') || jsonb_build_object(arg->>'kwarg', l.x->'v'))
                                  ORDER BY a.o, l.o), '[]'::jsonb)
                    FROM jsonb_array_elements(acc) WITH ORDINALITY AS a(x, o)
                    CROSS JOIN jsonb_array_elements(list) WITH ORDINALITY AS l(x, o));
        ELSE
            IF jsonb_array_length(acc) <> jsonb_array_length(list) THEN
                outcome := 'FAILED';
                problem := 'MapError: zip of ' || jsonb_array_length(acc) || ' and ' || jsonb_array_length(list)
                           || ' items (' || (arg->>'kwarg') || '): zipped arguments need equal lengths';
                EXIT;
            END IF;
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                      'k', a.x->'k',
                                      'kw', (a.x->'kw') || jsonb_build_object(arg->>'kwarg', l.x->'v'))
                                  ORDER BY a.o), '[]'::jsonb)
                    FROM jsonb_array_elements(acc) WITH ORDINALITY AS a(x, o)
                    JOIN jsonb_array_elements(list) WITH ORDINALITY AS l(x, o) ON l.o = a.o);
        END IF;
    END LOOP;
    IF problem IS NULL THEN
        n := jsonb_array_length(acc);
        IF n > (h.map_spec->>'max_length')::int THEN
            outcome := 'FAILED';
            problem := 'MapError: ' || n || ' items exceed max_map_length ' || (h.map_spec->>'max_length');
        ELSE
            problem := (SELECT 'MapError: map key ' || coalesce(to_jsonb(x->>'k')::text, 'null') || ' of item '
                               || (o - 1) || ' is not 1-100 letters, digits or _ . , : = -'
                        FROM jsonb_array_elements(acc) WITH ORDINALITY AS a(x, o)
                        WHERE (x->>'k') IS NULL OR (x->>'k') !~ '^[A-Za-z0-9_.,:=-]{1,100}$'
                              OR length(p_key) + length(x->>'k') > 198
                        ORDER BY o LIMIT 1);
            IF problem IS NULL AND (SELECT count(DISTINCT x->>'k') FROM jsonb_array_elements(acc) AS a(x)) < n THEN
                problem := 'MapError: the items repeat a map key (' || (
                    SELECT x->>'k' FROM jsonb_array_elements(acc) AS a(x) GROUP BY 1 HAVING count(*) > 1 LIMIT 1)
                    || '); name unique keys with map_key';
            END IF;
            IF problem IS NOT NULL THEN
                outcome := 'FAILED';
            END IF;
        END IF;
    END IF;
    IF problem IS NULL AND n = 0 THEN
        outcome := CASE WHEN h.map_spec->>'on_empty' = 'success' THEN 'SUCCEEDED' ELSE 'SKIPPED' END;
        problem := 'no items to map (on_empty ' || coalesce(h.map_spec->>'on_empty', 'skip') || ')';
    END IF;
    IF problem IS NOT NULL THEN
        UPDATE orc_tasks t SET state = outcome, finished_at = now(),
            result = CASE WHEN outcome = 'SUCCEEDED' THEN '[]'::json ELSE t.result END,
            error = CASE WHEN outcome = 'FAILED' THEN problem ELSE t.error END,
            -- a map that could not expand fails its run (a header otherwise leaves that to its children)
            decides_run = (outcome = 'FAILED'),
            skip_reason = CASE WHEN outcome <> 'SKIPPED' THEN NULL
                               WHEN left(problem, 8) = 'no items' THEN 'empty_map' ELSE 'upstream_skipped' END
        WHERE t.run_id = p_run AND t.key = p_key;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, p_key, h.attempt, 'PENDING', outcome, p_actor, p_by, p_why || '; ' || problem, true, now());
        RETURN json_build_object('state', outcome, 'readied', 0, 'children', h.children);
    END IF;
    win := coalesce((h.map_spec->>'window')::int, n);
    IF n > win THEN
        -- a wide map: the first window now, the rest by orc_map_window_v1 as children finish
        UPDATE orc_tasks t SET map_items = acc, map_next = win, map_refill = win - win / 2
        WHERE t.run_id = p_run AND t.key = p_key;
        acc := (SELECT jsonb_agg(acc -> i ORDER BY i) FROM generate_series(0, win - 1) AS i);
    END IF;
    readied := orc_map_insert_v1(p_run, p_key, acc, 0, n, NULL, p_actor, p_by, p_why);
    RETURN json_build_object('state', 'MAPPED', 'readied', readied, 'children', h.children);
END
$$;

-- orc_map_insert_v1: the rows of one expansion (orc_expand_v1's) or of one more window of it
-- (orc_map_window_v1's). p_items is the slice [{"k", "kw"}] that starts at map index p_offset of
-- p_total items; p_item_of, for a node mapped item by item, is the map whose child of the same
-- key holds each item (its result is passed at claim time). The first slice (p_offset 0) also
-- moves the node PENDING -> MAPPED with its total, widens its downstream's counters and grows
-- the run's task counts by p_total. Recurses into the nodes mapped item by item over this one,
-- with the same slice. Returns how many children it made READY.

CREATE OR REPLACE FUNCTION orc_map_insert_v1(p_run text, p_key text, p_items jsonb, p_offset integer,
    p_total integer, p_item_of text, p_actor text, p_by text, p_why text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    h record;
    n int := jsonb_array_length(p_items);
    chained text[];
    plain json;
    cap int;
    readied int;
    c text;
BEGIN
    SELECT t.* INTO h FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    -- the downstream nodes mapped item by item over this node, and the others
    chained := ARRAY(SELECT d.key FROM orc_tasks d
                     WHERE d.run_id = p_run AND d.key IN (SELECT json_array_elements_text(h.children))
                       AND d.map_spec->>'per_item' = p_key ORDER BY d.key);
    plain := (SELECT coalesce(json_agg(k), '[]'::json) FROM json_array_elements_text(h.children) AS k
              WHERE NOT (k = ANY (chained)));
    -- READY: the first max_active of the map (later ones wait PENDING for a sibling to finish),
    -- every child of a map without it; a child mapped item by item waits for its item
    cap := CASE WHEN p_item_of IS NOT NULL THEN 0
                WHEN h.map_spec->>'max_active' IS NULL THEN n
                ELSE greatest(0, (h.map_spec->>'max_active')::int - p_offset) END;
    INSERT INTO orc_tasks (run_id, key, task_name, args, kwargs, state, attempt, max_attempts, backoff, trigger_rule,
        n_upstream, n_done, n_succeeded, n_failed, n_upstream_failed, n_skipped, n_setup, n_setup_ok, n_setup_skipped,
        wants_upstream, queue, priority, priority_rank, tenant, soft_time_limit, time_limit, ready_at, children,
        retry_on, no_retry_on, fingerprint_streak, lease_losses, pool, pool_slots, rate_limit, deadline_seconds,
        deadline_at, decides_run, map_parent, map_index, map_key, map_item_from, map_total, map_done, map_ok,
        map_failed, map_skipped)
    SELECT p_run, p_key || '[' || (x->>'k') || ']', h.task_name, h.args,
           CASE WHEN p_item_of IS NULL THEN (h.kwargs::jsonb || (x->'kw'))::json ELSE h.kwargs END,
           CASE WHEN o <= cap THEN 'READY' ELSE 'PENDING' END, 1, h.max_attempts, h.backoff, 'all_success',
           CASE WHEN p_item_of IS NULL THEN 0 ELSE 1 END, 0, 0, 0, 0, 0, 0, 0, 0,
           h.wants_upstream, h.queue, h.priority, h.priority_rank, h.tenant, h.soft_time_limit, h.time_limit,
           -- in map order, and an item's later stages as old as its first: a chained map runs
           -- item by item (admission takes the oldest READY first)
           now() + (p_offset + o - 1) * interval '1 microsecond',
           CASE WHEN cardinality(chained) = 0 THEN plain
                ELSE (SELECT json_agg(v) FROM (
                          SELECT json_array_elements(plain) AS v
                          UNION ALL SELECT to_json(cc || '[' || (x->>'k') || ']') FROM unnest(chained) AS cc) AS kk)
           END,
           h.retry_on, h.no_retry_on, 0, 0, h.pool, h.pool_slots, h.rate_limit, h.deadline_seconds, h.deadline_at,
           true, p_key, (p_offset + o - 1)::int, x->>'k',
           CASE WHEN p_item_of IS NULL THEN NULL ELSE p_item_of || '[' || (x->>'k') || ']' END, 0, 0, 0, 0, 0
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(x, o);
    readied := LEAST(cap, n);
    IF readied > 0 THEN
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        SELECT p_run, p_key || '[' || (x->>'k') || ']', 1, 'PENDING', 'READY', p_actor, p_by,
               'mapped from ' || p_key || ' (item ' || (p_offset + o - 1) || ')', true, now()
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(x, o) WHERE o <= cap;
    END IF;
    IF p_offset = 0 THEN
        -- each downstream node counts the children instead of the node
        IF p_total <> 1 AND json_array_length(plain) > 0 THEN
            UPDATE orc_tasks d SET n_upstream = d.n_upstream + p_total - 1
            WHERE d.run_id = p_run AND d.key IN (SELECT json_array_elements_text(plain));
        END IF;
        UPDATE orc_tasks t SET state = 'MAPPED', map_total = p_total, map_done = 0, map_ok = 0, map_failed = 0,
                               map_skipped = 0, map_max_active = (h.map_spec->>'max_active')::int
        WHERE t.run_id = p_run AND t.key = p_key;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, p_key, h.attempt, 'PENDING', 'MAPPED', p_actor, p_by,
                coalesce(p_why || '; ', '') || 'mapped into ' || p_total || ' task(s)'
                || CASE WHEN p_item_of IS NULL THEN '' ELSE ' item by item over ' || p_item_of END
                || CASE WHEN n < p_total THEN ', the first ' || n || ' now, the rest in windows' ELSE '' END,
                true, now());
        UPDATE orc_runs SET task_count = task_count + p_total, open_tasks = open_tasks + p_total WHERE id = p_run;
    END IF;
    FOREACH c IN ARRAY chained LOOP
        readied := readied + orc_map_insert_v1(p_run, c, (
            SELECT jsonb_agg(jsonb_build_object('k', x->'k', 'kw', '{}'::jsonb) ORDER BY o)
            FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(x, o)), p_offset, p_total, p_key, p_actor, p_by,
            NULL);
    END LOOP;
    RETURN readied;
END
$$;

-- orc_map_window_v1: the next window of a wide map's children. A map of more items than its
-- window (map_spec "window") inserts the first window at expansion and keeps the rest in
-- map_items; when its unfinished materialised children fall to half a window (orc_settle_v2
-- checks on each child that finishes), the next window is inserted the same way (items by
-- index from map_items: no walk of the whole list). Returns how many children it made READY.

CREATE OR REPLACE FUNCTION orc_map_window_v1(p_run text, p_key text, p_actor text, p_by text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    h record;
    w int;
    slice jsonb;
    readied int;
BEGIN
    SELECT t.map_items, t.map_next, t.map_total, t.map_spec INTO h FROM orc_tasks t
    WHERE t.run_id = p_run AND t.key = p_key AND t.state = 'MAPPED' FOR UPDATE;
    IF NOT FOUND OR h.map_items IS NULL OR h.map_next >= h.map_total THEN
        RETURN 0;
    END IF;
    w := LEAST((h.map_spec->>'window')::int, h.map_total - h.map_next);
    slice := (SELECT jsonb_agg(h.map_items -> i ORDER BY i) FROM generate_series(h.map_next, h.map_next + w - 1) AS i);
    UPDATE orc_tasks t SET map_next = h.map_next + w,
                           map_items = CASE WHEN h.map_next + w >= h.map_total THEN NULL ELSE t.map_items END,
                           -- the next window once half of this one is done (none after the last)
                           map_refill = CASE WHEN h.map_next + w >= h.map_total THEN NULL
                                             ELSE h.map_next + w - (h.map_spec->>'window')::int / 2 END
    WHERE t.run_id = p_run AND t.key = p_key;
    readied := orc_map_insert_v1(p_run, p_key, slice, h.map_next, h.map_total, NULL, p_actor, p_by, NULL);
    RETURN readied;
END
$$;

-- orc_settle_v2: a task became terminal; count it into its children and decide them.
--
-- Adds the finished task to each child's counters (one UPDATE ... RETURNING per child, by
-- primary key: never a scan of the run), decides the child's trigger rule (orc_decide_v2),
-- moves decided children PENDING -> READY / SKIPPED / UPSTREAM_FAILED with their ledger rows
-- (a verdict reached before every parent is done says "early verdict"), expands a mapped child
-- whose rule says READY (orc_expand_v1) instead, and cascades the terminal ones the same way.
-- A finished child of a map is also counted into its map's header: a wide map inserts its next
-- window of children (orc_map_window_v1), a map held by max_active admits its next waiting
-- child, and the header closes (MAPPED -> SUCCEEDED / FAILED /
-- SKIPPED, a summary that does not decide the run) after its last child. The run closes
-- (RUNNING -> SUCCEEDED / FAILED) when no task is left open: FAILED when a task that decides
-- the run (not a teardown, unless it asked to; not a map header) ended FAILED or
-- UPSTREAM_FAILED. The actor that caused the first change acts for the cascade.
-- Returns how many tasks it made READY (orc_succeed_v2 passes its slot on when none).

CREATE OR REPLACE FUNCTION orc_settle_v2(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    q_keys text[] := ARRAY[p_key];
    q_states text[] := ARRAY[p_state];
    q_children json[] := ARRAY[p_children];
    q_setup boolean[];
    q_parents text[];
    i int := 1;
    closed int := 1;
    readied int := 0;
    kids text[];
    kid text;
    r record;
    m record;
    hdr record;
    verdict text;
    why text;
    expanded json;
    run_row record;
    failed int;
    outcome text;
BEGIN
    SELECT t.role = 'setup' AS setup, t.map_parent INTO r FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    q_setup := ARRAY[coalesce(r.setup, false)];
    q_parents := ARRAY[r.map_parent];
    WHILE i <= array_length(q_keys, 1) LOOP
        IF q_children[i] IS NOT NULL AND json_typeof(q_children[i]) = 'array' THEN
            kids := ARRAY(SELECT json_array_elements_text(q_children[i]));
            FOREACH kid IN ARRAY kids LOOP
                UPDATE orc_tasks t SET
                    n_done = t.n_done + 1,
                    n_succeeded = t.n_succeeded + (q_states[i] = 'SUCCEEDED')::int,
                    n_failed = t.n_failed + (q_states[i] = 'FAILED')::int,
                    n_upstream_failed = t.n_upstream_failed + (q_states[i] = 'UPSTREAM_FAILED')::int,
                    n_skipped = t.n_skipped + (q_states[i] = 'SKIPPED')::int,
                    n_setup_ok = t.n_setup_ok + (q_setup[i] AND q_states[i] = 'SUCCEEDED')::int,
                    n_setup_skipped = t.n_setup_skipped + (q_setup[i] AND q_states[i] = 'SKIPPED')::int
                WHERE t.run_id = p_run AND t.key = kid
                RETURNING t.key, t.state, t.attempt, t.trigger_rule, t.n_upstream, t.n_done, t.n_succeeded,
                          t.n_failed, t.n_upstream_failed, t.n_skipped, t.n_setup, t.n_setup_ok, t.n_setup_skipped,
                          t.min_success_ratio, t.map_spec IS NOT NULL AS mapped INTO r;
                CONTINUE WHEN NOT FOUND OR r.state <> 'PENDING';
                verdict := orc_decide_v2(r.trigger_rule, r.n_upstream, r.n_done, r.n_succeeded, r.n_failed,
                                         r.n_upstream_failed, r.n_skipped, r.n_setup, r.n_setup_ok,
                                         r.n_setup_skipped, r.min_success_ratio);
                CONTINUE WHEN verdict IS NULL;
                why := 'upstream ' || q_keys[i] || ' ' || q_states[i]
                       || CASE WHEN r.n_done < r.n_upstream
                               THEN '; early verdict (' || r.n_done || ' of ' || r.n_upstream || ' upstream done)'
                               ELSE '' END;
                IF verdict = 'READY' AND r.mapped THEN
                    expanded := orc_expand_v1(p_run, r.key, p_actor, p_by, why);
                    CONTINUE WHEN expanded IS NULL;
                    readied := readied + (expanded->>'readied')::int;
                    IF expanded->>'state' <> 'MAPPED' THEN
                        closed := closed + 1;
                        q_keys := q_keys || r.key;
                        q_states := q_states || (expanded->>'state');
                        q_children := q_children || (expanded->'children');
                        q_setup := q_setup || false;
                        q_parents := q_parents || NULL::text;
                    END IF;
                    CONTINUE;
                END IF;
                UPDATE orc_tasks t SET
                    state = verdict,
                    ready_at = CASE WHEN verdict = 'READY' THEN coalesce(t.ready_at, now()) ELSE t.ready_at END,
                    finished_at = CASE WHEN verdict = 'READY' THEN t.finished_at ELSE now() END,
                    skip_reason = CASE WHEN verdict = 'SKIPPED' THEN 'upstream_skipped' ELSE t.skip_reason END
                WHERE t.run_id = p_run AND t.key = r.key AND coalesce(t.state, '') = 'PENDING'
                RETURNING t.key, t.attempt, t.children, t.role = 'setup' AS setup, t.map_parent INTO m;
                IF FOUND THEN
                    INSERT INTO orc_task_events
                        (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
                    VALUES (p_run, m.key, m.attempt, 'PENDING', verdict, p_actor, p_by, why, true, now());
                    IF verdict = 'READY' THEN
                        readied := readied + 1;
                    ELSE
                        closed := closed + 1;
                        q_keys := q_keys || m.key;
                        q_states := q_states || verdict;
                        q_children := q_children || m.children;
                        q_setup := q_setup || coalesce(m.setup, false);
                        q_parents := q_parents || m.map_parent;
                    END IF;
                ELSE
                    PERFORM orc_reject_v1(p_run, r.key, r.attempt, verdict, p_actor, why);
                END IF;
            END LOOP;
        END IF;
        IF q_parents[i] IS NOT NULL THEN
            -- a child of a map: counted into its header
            UPDATE orc_tasks t SET
                map_done = t.map_done + 1,
                map_ok = t.map_ok + (q_states[i] = 'SUCCEEDED')::int,
                map_failed = t.map_failed + (q_states[i] IN ('FAILED', 'UPSTREAM_FAILED'))::int,
                map_skipped = t.map_skipped + (q_states[i] = 'SKIPPED')::int
            WHERE t.run_id = p_run AND t.key = q_parents[i]
            RETURNING t.key, t.state, t.attempt, t.map_total, t.map_done, t.map_ok, t.map_failed, t.map_skipped,
                      t.map_max_active, t.map_refill INTO hdr;
            IF FOUND AND hdr.state = 'MAPPED' AND hdr.map_done >= hdr.map_refill THEN
                -- a wide map's next window of children
                readied := readied + orc_map_window_v1(p_run, hdr.key, p_actor, p_by);
            END IF;
            IF FOUND AND hdr.state = 'MAPPED' THEN
                IF hdr.map_done >= hdr.map_total THEN
                    outcome := CASE WHEN hdr.map_failed > 0 THEN 'FAILED'
                                    WHEN hdr.map_skipped >= hdr.map_total THEN 'SKIPPED' ELSE 'SUCCEEDED' END;
                    UPDATE orc_tasks t SET state = outcome, finished_at = now(),
                        skip_reason = CASE WHEN outcome = 'SKIPPED' THEN 'upstream_skipped' ELSE t.skip_reason END
                    WHERE t.run_id = p_run AND t.key = hdr.key AND t.state = 'MAPPED';
                    INSERT INTO orc_task_events
                        (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
                    VALUES (p_run, hdr.key, hdr.attempt, 'MAPPED', outcome, p_actor, p_by,
                            hdr.map_total || ' mapped task(s) done: ' || hdr.map_ok || ' succeeded, '
                            || hdr.map_failed || ' failed, ' || hdr.map_skipped || ' skipped', true, now());
                    closed := closed + 1;
                ELSIF hdr.map_max_active IS NOT NULL THEN
                    -- the next child held back by max_active
                    UPDATE orc_tasks t SET state = 'READY', ready_at = coalesce(t.ready_at, now())
                    WHERE (t.run_id, t.key) = (
                        SELECT w.run_id, w.key FROM orc_tasks w
                        WHERE w.run_id = p_run AND w.map_parent = hdr.key AND w.state = 'PENDING' AND w.n_upstream = 0
                        ORDER BY w.map_index LIMIT 1 FOR UPDATE SKIP LOCKED)
                    RETURNING t.key, t.attempt INTO m;
                    IF FOUND THEN
                        INSERT INTO orc_task_events
                            (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
                        VALUES (p_run, m.key, m.attempt, 'PENDING', 'READY', p_actor, p_by,
                                'map ' || hdr.key || ': a slot of max_active freed', true, now());
                        readied := readied + 1;
                    END IF;
                END IF;
            END IF;
        END IF;
        i := i + 1;
    END LOOP;
    UPDATE orc_runs SET open_tasks = open_tasks - closed WHERE id = p_run RETURNING open_tasks, state INTO run_row;
    IF FOUND AND run_row.open_tasks <= 0 AND run_row.state = 'RUNNING' THEN
        SELECT count(*) INTO failed FROM orc_tasks
        WHERE run_id = p_run AND state IN ('FAILED', 'UPSTREAM_FAILED') AND decides_run;
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

-- orc_claim_v2: a worker's claim, QUEUED -> RUNNING for p_attempt, with the lease.
--
-- The attempt is the fencing token and the message's task name must be the node's. Returns
-- {"claimed": true, "args", "kwargs", "wants_upstream", "upstream"} (upstream: the results of
-- the parents that succeeded, for tasks that want them; a mapped parent's is the list of its
-- children's results in map order, those that succeeded; a child of a map has its map's
-- parents) or {"claimed": false, "conflict"} with the rejected event written (nothing is
-- written for an unknown task). A child of a map mapped item by item gets its item, the result
-- of the same key's child of the map before it, as its mapped keyword.

CREATE OR REPLACE FUNCTION orc_claim_v2(p_run text, p_key text, p_attempt integer, p_worker text,
    p_lease double precision, p_task text)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    row record;
    upstream json;
    conflict text;
    kwargs json;
    kwarg text;
    item json;
BEGIN
    UPDATE orc_tasks t SET state = 'RUNNING', started_at = now(), heartbeat_at = now(),
                           lease_expires_at = now() + make_interval(secs => p_lease), worker = p_worker
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'QUEUED' AND t.attempt = p_attempt
      AND t.task_name = p_task
    RETURNING t.args, t.kwargs, t.wants_upstream, t.map_parent, t.map_item_from INTO row;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'RUNNING', 'worker',
                                  'claim by ' || p_worker || ' for a message of ' || p_task);
        RETURN json_build_object('claimed', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'QUEUED', 'RUNNING', 'worker', NULL, 'claim by ' || p_worker, true, now());
    kwargs := row.kwargs;
    IF row.map_item_from IS NOT NULL THEN
        SELECT h.map_spec->'args'->0->>'kwarg' INTO kwarg FROM orc_tasks h
        WHERE h.run_id = p_run AND h.key = row.map_parent;
        SELECT t.result INTO item FROM orc_tasks t WHERE t.run_id = p_run AND t.key = row.map_item_from;
        kwargs := (kwargs::jsonb || jsonb_build_object(kwarg, item::jsonb))::json;
    END IF;
    IF row.wants_upstream THEN
        SELECT json_object_agg(t.key, CASE
                   WHEN t.map_spec IS NULL THEN t.result
                   WHEN left(row.map_item_from, length(t.key) + 1) = t.key || '[' THEN item
                   ELSE (SELECT coalesce(json_agg(c.result ORDER BY c.map_index), '[]'::json) FROM orc_tasks c
                         WHERE c.run_id = p_run AND c.map_parent = t.key AND c.state = 'SUCCEEDED') END) INTO upstream
        FROM orc_edges e JOIN orc_tasks t ON t.run_id = e.run_id AND t.key = e.parent_key
        WHERE e.run_id = p_run AND e.child_key = coalesce(row.map_parent, p_key)
          AND (t.state = 'SUCCEEDED' OR t.map_spec IS NOT NULL AND t.state IN ('MAPPED', 'FAILED'));
    END IF;
    RETURN json_build_object('claimed', true, 'args', row.args, 'kwargs', kwargs,
                             'wants_upstream', row.wants_upstream, 'upstream', coalesce(upstream, '{}'::json));
END
$$;

-- orc_succeed_v2: RUNNING -> SUCCEEDED for p_attempt with the result, settled and admitted.
--
-- One statement, so one round trip in autocommit: the result checked (orc_result_problem_v1),
-- the compare-and-set and its ledger row, a branch's or short circuit's skips
-- (orc_follow_v1), the settlement (orc_settle_v2), then what to publish (orc_dispatch_v1).
-- Returns {"accepted": true, "dispatches": [...]}, {"accepted": false, "conflict"} or, for a
-- result its node cannot use (nothing written), {"accepted": false, "invalid":
-- "BranchError: ..." | "MapError: ..."}: the worker then fails the attempt.

CREATE OR REPLACE FUNCTION orc_succeed_v2(p_run text, p_key text, p_attempt integer, p_result json,
    p_window integer, p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    kids json;
    who text;
    flow text;
    feeds boolean;
    conflict text;
    problem text;
    readied int := 0;
BEGIN
    SELECT t.flow, t.feeds_map INTO flow, feeds FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    IF flow IS NOT NULL OR feeds THEN
        problem := orc_result_problem_v1(p_run, p_key, p_result);
        IF problem IS NOT NULL THEN
            RETURN json_build_object('accepted', false, 'invalid', problem);
        END IF;
    END IF;
    UPDATE orc_tasks t SET state = 'SUCCEEDED', result = p_result, finished_at = now(), lease_expires_at = NULL
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'RUNNING' AND t.attempt = p_attempt
    RETURNING t.children, t.worker INTO kids, who;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'SUCCEEDED', 'worker', NULL);
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'SUCCEEDED', 'worker', NULL, NULL, true, now());
    IF flow IS NOT NULL THEN
        readied := orc_follow_v1(p_run, p_key, flow, kids, p_result, 'worker', NULL);
    END IF;
    readied := readied + orc_settle_v2(p_run, p_key, 'SUCCEEDED', kids, 'worker', NULL);
    RETURN json_build_object('accepted', true,
                             'dispatches', orc_dispatch_v1(readied, who, p_window, p_worker_ttl, p_depth, p_aging));
END
$$;

-- orc_result_problem_v1: why a result cannot be its node's, or NULL. A branch's result must be
-- the key of a direct child or a list of them; a parent that a map maps over must return a
-- JSON list or object of at most the map's max_length items.

CREATE OR REPLACE FUNCTION orc_result_problem_v1(p_run text, p_key text, p_result json)
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    t record;
    d record;
    kids text[];
    bad text;
    n int;
BEGIN
    SELECT x.flow, x.children, x.feeds_map INTO t FROM orc_tasks x WHERE x.run_id = p_run AND x.key = p_key;
    kids := ARRAY(SELECT json_array_elements_text(coalesce(t.children, '[]'::json)));
    IF t.flow = 'branch' THEN
        IF json_typeof(p_result) = 'string' THEN
            bad := CASE WHEN NOT (p_result #>> '{}') = ANY (kids) THEN p_result #>> '{}' END;
        ELSIF json_typeof(p_result) = 'array' THEN
            IF EXISTS (SELECT 1 FROM json_array_elements(p_result) e WHERE json_typeof(e) <> 'string') THEN
                RETURN 'BranchError: a branch returns a child key or a list of child keys, not a list holding '
                       || (SELECT json_typeof(e) FROM json_array_elements(p_result) e
                           WHERE json_typeof(e) <> 'string' LIMIT 1) || 's';
            END IF;
            bad := (SELECT e FROM json_array_elements_text(p_result) e WHERE NOT e = ANY (kids) LIMIT 1);
        ELSE
            RETURN 'BranchError: a branch returns a child key or a list of child keys, not a '
                   || coalesce(json_typeof(p_result), 'null');
        END IF;
        IF bad IS NOT NULL THEN
            RETURN 'BranchError: ' || to_json(bad)::text || ' is not a direct child of ' || p_key
                   || ' (its children: ' || array_to_string(kids, ', ') || ')';
        END IF;
    END IF;
    IF t.feeds_map THEN
        FOR d IN SELECT c.key, c.map_spec FROM orc_tasks c
                 WHERE c.run_id = p_run AND c.key = ANY (kids) AND c.map_spec IS NOT NULL
                   AND c.map_spec->>'per_item' IS NULL
                   AND EXISTS (SELECT 1 FROM json_array_elements(c.map_spec->'args') a WHERE a->>'from' = p_key)
                 ORDER BY c.key LOOP
            IF coalesce(json_typeof(p_result), 'null') NOT IN ('array', 'object') THEN
                RETURN 'MapError: ' || d.key || ' maps over the result of ' || p_key
                       || ', which must be a JSON list or object, not a ' || coalesce(json_typeof(p_result), 'null');
            END IF;
            n := CASE WHEN json_typeof(p_result) = 'array' THEN json_array_length(p_result)
                      ELSE (SELECT count(*) FROM json_object_keys(p_result)) END;
            IF n > (d.map_spec->>'max_length')::int THEN
                RETURN 'MapError: ' || d.key || ' maps over ' || n || ' items of ' || p_key
                       || ', over its max_map_length ' || (d.map_spec->>'max_length');
            END IF;
        END LOOP;
    END IF;
    RETURN NULL;
END
$$;

-- orc_follow_v1: what a branch or a short circuit that just succeeded leaves out.
--
-- A branch (p_flow 'branch') follows the children its result names: each other direct child
-- that is still PENDING and is not reachable from a followed one is SKIPPED (reason
-- branch_not_taken) and settled, so its own children follow their trigger rules. A short
-- circuit ('short_circuit') whose result is falsy (null, false, 0, "", [], {}) skips every
-- PENDING task downstream of it (reason short_circuit), whatever their trigger rules. Called
-- before the node's own settlement; returns how many tasks the settlements made READY.

CREATE OR REPLACE FUNCTION orc_follow_v1(p_run text, p_key text, p_flow text, p_children json, p_result json,
    p_actor text, p_by text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    followed text[];
    m record;
    readied int := 0;
    n int := 0;
    falsy boolean;
BEGIN
    IF p_flow = 'branch' THEN
        followed := CASE WHEN json_typeof(p_result) = 'array' THEN ARRAY(SELECT json_array_elements_text(p_result))
                         ELSE ARRAY[p_result #>> '{}'] END;
        FOR m IN
            WITH RECURSIVE reach(key) AS (
                SELECT unnest(followed)
                UNION
                SELECT e.child_key FROM orc_edges e JOIN reach ON e.run_id = p_run AND e.parent_key = reach.key
            )
            UPDATE orc_tasks t SET state = 'SKIPPED', finished_at = now(), skip_reason = 'branch_not_taken'
            WHERE t.run_id = p_run AND t.key IN (SELECT json_array_elements_text(p_children))
              AND t.state = 'PENDING' AND NOT t.key IN (SELECT key FROM reach)
            RETURNING t.key, t.attempt, t.children
        LOOP
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            VALUES (p_run, m.key, m.attempt, 'PENDING', 'SKIPPED', p_actor, p_by,
                    'branch_not_taken: ' || p_key || ' followed ' || array_to_string(followed, ', '), true, now());
            readied := readied + orc_settle_v2(p_run, m.key, 'SKIPPED', m.children, p_actor, p_by);
        END LOOP;
        RETURN readied;
    END IF;
    falsy := p_result IS NULL OR (CASE json_typeof(p_result)
        WHEN 'null' THEN true WHEN 'boolean' THEN NOT (p_result #>> '{}')::boolean
        WHEN 'number' THEN (p_result #>> '{}')::numeric = 0 WHEN 'string' THEN p_result #>> '{}' = ''
        WHEN 'array' THEN json_array_length(p_result) = 0
        ELSE NOT EXISTS (SELECT 1 FROM json_object_keys(p_result)) END);
    IF p_flow = 'short_circuit' AND falsy THEN
        WITH RECURSIVE below(key) AS (
            SELECT json_array_elements_text(p_children)
            UNION
            SELECT e.child_key FROM orc_edges e JOIN below ON e.run_id = p_run AND e.parent_key = below.key
        ), skipped AS (
            UPDATE orc_tasks t SET state = 'SKIPPED', finished_at = now(), skip_reason = 'short_circuit'
            WHERE t.run_id = p_run AND t.key IN (SELECT key FROM below) AND t.state = 'PENDING'
            RETURNING t.key, t.attempt
        ), logged AS (
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            SELECT p_run, s.key, s.attempt, 'PENDING', 'SKIPPED', p_actor, p_by,
                   'short_circuit: ' || p_key || ' returned ' || left(coalesce(p_result::text, 'null'), 40), true, now()
            FROM skipped s
            RETURNING 1
        )
        SELECT count(*) INTO n FROM logged;
        IF n > 0 THEN
            UPDATE orc_runs SET open_tasks = open_tasks - n WHERE id = p_run;
        END IF;
    END IF;
    RETURN 0;
END
$$;

-- orc_dispatch_v1: what a worker's outcome publishes. When it made nothing READY and the worker
-- (p_worker, "<worker name>:<pid>" as its claim recorded it) is live, its slot is passed on
-- (orc_pass_slot_v1); otherwise the whole admission runs (orc_admit_v1).

CREATE OR REPLACE FUNCTION orc_dispatch_v1(p_readied integer, p_worker text, p_window integer,
    p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    dispatches json;
    group_queues text;
BEGIN
    IF p_readied = 0 THEN
        SELECT w.queues::text INTO group_queues FROM orc_workers w
        WHERE w.name = regexp_replace(p_worker, ':[0-9]+$', '')
          AND w.seen_at > now() - make_interval(secs => p_worker_ttl);
        IF FOUND THEN
            SELECT coalesce(json_agg(d), '[]'::json) INTO dispatches
            FROM orc_pass_slot_v1(group_queues, p_worker_ttl, p_depth, p_aging) d;
            RETURN dispatches;
        END IF;
    END IF;
    SELECT coalesce(json_agg(d ORDER BY d.priority_rank, d.ready_at), '[]'::json) INTO dispatches
    FROM orc_admit_v1(p_window, p_worker_ttl, p_depth, true, p_aging) d;
    RETURN dispatches;
END
$$;

-- orc_skip_v1: a task body raised orchestrator.Skip: RUNNING -> SKIPPED for p_attempt.
--
-- The compare-and-set (fenced by the attempt like a success) with its ledger row ("user: " and
-- the reason), the settlement (orc_settle_v2: the children follow their trigger rules), then
-- what to publish (orc_dispatch_v1). Returns {"accepted": true, "dispatches": [...]} or
-- {"accepted": false, "conflict"}.

CREATE OR REPLACE FUNCTION orc_skip_v1(p_run text, p_key text, p_attempt integer, p_reason text, p_window integer,
    p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    kids json;
    who text;
    conflict text;
    readied int;
BEGIN
    UPDATE orc_tasks t SET state = 'SKIPPED', finished_at = now(), lease_expires_at = NULL, skip_reason = 'user'
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'RUNNING' AND t.attempt = p_attempt
    RETURNING t.children, t.worker INTO kids, who;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'SKIPPED', 'worker', 'skip: ' || left(p_reason, 500));
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'SKIPPED', 'worker', NULL, 'user: ' || left(p_reason, 1000), true,
            now());
    readied := orc_settle_v2(p_run, p_key, 'SKIPPED', kids, 'worker', NULL);
    RETURN json_build_object('accepted', true,
                             'dispatches', orc_dispatch_v1(readied, who, p_window, p_worker_ttl, p_depth, p_aging));
END
$$;

-- orc_clear_v1: an operator's clear: the tasks p_keys go back to be run again.
--
-- Under the run's row lock, each task of p_keys (the caller has resolved --downstream /
-- --upstream / --only-failed into the list) moves to PENDING with attempt + 1, whatever it held:
-- a QUEUED or RUNNING attempt is fenced by the new attempt (its claim, its heartbeat and its
-- outcome are refused and recorded), and an outcome it had stays in its ledger row (the event's
-- result). Maps: a map cleared with the parent it maps over is expanded again when that parent
-- succeeds again (its children removed now, each with a "removed" ledger row, never counted
-- again; the maps chained on it too); a map cleared without it stays MAPPED and runs again the
-- children in p_keys (the caller lists them: all, or the failed ones); a map child cleared on its
-- own runs again and its map, closed or not, counts it out (MAPPED). Then orc_redecide_v1
-- counts, reopens and decides. Returns how many tasks it cleared.

CREATE OR REPLACE FUNCTION orc_clear_v1(p_run text, p_keys text[], p_actor text, p_by text, p_reason text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    keys text[] := p_keys;
    again text[];
    removed int := 0;
    n int;
    h record;
BEGIN
    PERFORM 1 FROM orc_runs WHERE id = p_run FOR UPDATE;
    -- a map cleared with what it maps over is expanded again (and the maps chained item by item
    -- on it): its children are removed (their ledger rows stay, with a "removed" row each)
    again := ARRAY(
        WITH RECURSIVE r(key) AS (
            SELECT t.key FROM orc_tasks t
            WHERE t.run_id = p_run AND t.key = ANY (keys) AND t.map_spec IS NOT NULL AND EXISTS (
                SELECT 1 FROM json_array_elements(t.map_spec->'args') a WHERE a->>'from' = ANY (keys))
            UNION
            SELECT d.key FROM r JOIN orc_tasks d ON d.run_id = p_run AND d.map_spec->>'per_item' = r.key
        )
        SELECT key FROM r);
    keys := ARRAY(SELECT DISTINCT k FROM unnest(keys || again) AS k);
    IF cardinality(again) > 0 THEN
        WITH gone AS (
            DELETE FROM orc_tasks c WHERE c.run_id = p_run AND c.map_parent = ANY (again)
            RETURNING c.key, c.state, c.attempt, c.result
        ), logged AS (
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted,
                                         at, kind, result)
            SELECT p_run, g.key, g.attempt, g.state, g.state, p_actor, p_by,
                   'removed: its map is expanded again (' || p_reason || ')', true, now(), 'removed', g.result
            FROM gone g
            RETURNING 1
        )
        SELECT count(*) INTO removed FROM logged;
        UPDATE orc_tasks t SET map_total = 0, map_done = 0, map_ok = 0, map_failed = 0, map_skipped = 0,
            map_items = NULL, map_next = NULL, map_refill = NULL, map_max_active = NULL
        WHERE t.run_id = p_run AND t.key = ANY (again);
        UPDATE orc_runs SET task_count = task_count - removed WHERE id = p_run;
    END IF;
    WITH old AS (
        SELECT t.key, t.state, t.attempt, t.result FROM orc_tasks t
        WHERE t.run_id = p_run AND t.key = ANY (keys) ORDER BY t.key FOR UPDATE
    ), moved AS (
        UPDATE orc_tasks t SET state = 'PENDING', attempt = t.attempt + 1, result = NULL, error = NULL,
            finished_at = NULL, started_at = NULL, dispatched_at = NULL, heartbeat_at = NULL,
            lease_expires_at = NULL, worker = NULL, ready_at = NULL, not_before = NULL, skip_reason = NULL,
            fingerprint = NULL, fingerprint_streak = 0, lease_losses = 0
        FROM old WHERE t.run_id = p_run AND t.key = old.key
        RETURNING t.key, t.attempt, old.state AS was, old.result AS had
    ), logged AS (
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at,
                                     result)
        SELECT p_run, m.key, m.attempt, m.was, 'PENDING', p_actor, p_by, p_reason, true, now(), m.had FROM moved m
        RETURNING 1
    )
    SELECT count(*) INTO n FROM logged;
    -- an expanded map whose children run again stays MAPPED, its counts taken again from them;
    -- so does a map some of whose children were cleared on their own (a closed one reopens)
    FOR h IN SELECT t.key, t.state, t.attempt FROM orc_tasks t
             WHERE t.run_id = p_run AND t.map_total > 0 AND NOT (t.key = ANY (again))
               AND (t.key = ANY (keys) OR t.key IN (SELECT c.map_parent FROM orc_tasks c
                                                  WHERE c.run_id = p_run AND c.key = ANY (keys)))
             ORDER BY t.key LOOP
        UPDATE orc_tasks t SET state = 'MAPPED', finished_at = NULL,
            map_done = x.done, map_ok = x.ok, map_failed = x.failed, map_skipped = x.skipped
        FROM (SELECT count(*) FILTER (WHERE c.state IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED')) AS done,
                     count(*) FILTER (WHERE c.state = 'SUCCEEDED') AS ok,
                     count(*) FILTER (WHERE c.state IN ('FAILED', 'UPSTREAM_FAILED')) AS failed,
                     count(*) FILTER (WHERE c.state = 'SKIPPED') AS skipped
              FROM orc_tasks c WHERE c.run_id = p_run AND c.map_parent = h.key) AS x
        WHERE t.run_id = p_run AND t.key = h.key;
        IF h.state <> 'MAPPED' THEN
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted,
                                         at)
            VALUES (p_run, h.key, (SELECT t.attempt FROM orc_tasks t WHERE t.run_id = p_run AND t.key = h.key),
                    CASE WHEN h.key = ANY (keys) THEN 'PENDING' ELSE h.state END, 'MAPPED', p_actor, p_by,
                    'its children run again (' || p_reason || ')', true, now());
        END IF;
    END LOOP;
    PERFORM orc_redecide_v1(p_run, keys, p_actor, p_by, p_reason);
    RETURN n;
END
$$;

-- orc_mark_v1: an operator sets a task's outcome by hand (Airflow's Mark Success / Mark Failed):
-- SUCCEEDED, FAILED or SKIPPED. A QUEUED or RUNNING attempt is fenced (attempt + 1). The tasks
-- below it that its old outcome decided without running them (UPSTREAM_FAILED or SKIPPED by
-- their rule, never started) go back to PENDING, and orc_redecide_v1 decides them again with
-- its new outcome: its children follow their trigger rules. A map's child is counted again into
-- its map, which closes or reopens as its children say. Returns the state it held.

CREATE OR REPLACE FUNCTION orc_mark_v1(p_run text, p_key text, p_state text, p_actor text, p_by text)
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    t record;
    hdr record;
    undone text[];
    why text := 'marked ' || p_state || ' by hand';
BEGIN
    PERFORM 1 FROM orc_runs WHERE id = p_run FOR UPDATE;
    SELECT x.state, x.attempt, x.children, x.map_parent,
           (SELECT h.state FROM orc_tasks h WHERE h.run_id = p_run AND h.key = x.map_parent) AS header_state
    INTO t FROM orc_tasks x WHERE x.run_id = p_run AND x.key = p_key FOR UPDATE;
    -- what its outcome decided without running it, transitively
    WITH RECURSIVE below(key) AS (
        SELECT k FROM json_array_elements_text(coalesce(t.children, '[]'::json)) AS k
        UNION
        SELECT c.k FROM below JOIN orc_tasks b ON b.run_id = p_run AND b.key = below.key,
             json_array_elements_text(coalesce(b.children, '[]'::json)) AS c(k)
        WHERE b.state IN ('UPSTREAM_FAILED', 'SKIPPED') AND b.started_at IS NULL
    )
    SELECT array_agg(b.key ORDER BY b.key) INTO undone
    FROM below JOIN orc_tasks b ON b.run_id = p_run AND b.key = below.key
    WHERE b.state IN ('UPSTREAM_FAILED', 'SKIPPED') AND b.started_at IS NULL;
    WITH moved AS (
        UPDATE orc_tasks b SET state = 'PENDING', finished_at = NULL, skip_reason = NULL
        WHERE b.run_id = p_run AND b.key = ANY (coalesce(undone, '{}'))
        RETURNING b.key, b.attempt
    )
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    SELECT p_run, m.key, m.attempt, (SELECT e.to_state FROM orc_task_events e WHERE e.run_id = p_run AND e.key = m.key
                                     AND e.accepted ORDER BY e.id DESC LIMIT 1),
           'PENDING', p_actor, p_by, 'decided again: ' || p_key || ' ' || why, true, now()
    FROM moved m;
    UPDATE orc_tasks x SET state = p_state, finished_at = now(), lease_expires_at = NULL,
        attempt = x.attempt + (x.state IN ('QUEUED', 'RUNNING'))::int,
        skip_reason = CASE WHEN p_state = 'SKIPPED' THEN 'user' END,
        error = CASE WHEN p_state = 'FAILED' THEN coalesce(x.error, why) END
    WHERE x.run_id = p_run AND x.key = p_key;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    SELECT p_run, p_key, x.attempt, t.state, p_state, p_actor, p_by, why, true, now()
    FROM orc_tasks x WHERE x.run_id = p_run AND x.key = p_key;
    IF t.map_parent IS NOT NULL THEN
        -- a map's child: its map counts it again, and closes (or reopens) as its children say
        UPDATE orc_tasks h SET map_done = x.done, map_ok = x.ok, map_failed = x.failed, map_skipped = x.skipped,
            state = CASE WHEN x.done < h.map_total THEN 'MAPPED' WHEN x.failed > 0 THEN 'FAILED'
                         WHEN x.skipped >= h.map_total THEN 'SKIPPED' ELSE 'SUCCEEDED' END,
            finished_at = CASE WHEN x.done < h.map_total THEN NULL ELSE now() END
        FROM (SELECT count(*) FILTER (WHERE c.state IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED')) AS done,
                     count(*) FILTER (WHERE c.state = 'SUCCEEDED') AS ok,
                     count(*) FILTER (WHERE c.state IN ('FAILED', 'UPSTREAM_FAILED')) AS failed,
                     count(*) FILTER (WHERE c.state = 'SKIPPED') AS skipped
              FROM orc_tasks c WHERE c.run_id = p_run AND c.map_parent = t.map_parent) AS x
        WHERE h.run_id = p_run AND h.key = t.map_parent
        RETURNING h.key, h.attempt, h.state INTO hdr;
        IF hdr.state IS DISTINCT FROM t.header_state THEN
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted,
                                         at)
            VALUES (p_run, hdr.key, hdr.attempt, t.header_state, hdr.state, p_actor, p_by,
                    'its child ' || p_key || ' ' || why, true, now());
        END IF;
    END IF;
    PERFORM orc_redecide_v1(p_run, ARRAY(SELECT json_array_elements_text(coalesce(t.children, '[]'::json)))
                                   || coalesce(undone, '{}'), p_actor, p_by, why);
    RETURN t.state;
END
$$;

-- orc_redecide_v1: after a clear or a mark, the counters of p_keys and of their PENDING
-- children are counted again from their parents' states (edges and map rows: never the whole
-- run; n_upstream too, a map expanded or not), the run's
-- open tasks recounted and a final run reopened (RUNNING, with its event) when it has tasks to
-- run again or its outcome changed, then each PENDING
-- task of p_keys and their children is decided by its rule (orc_decide_v2; a root or an
-- "always" is READY; a child that a branch not cleared did not follow is SKIPPED again,
-- branch_not_taken), a terminal verdict settled (orc_settle_v2 cascades it and closes the run
-- when nothing is left open).

CREATE OR REPLACE FUNCTION orc_redecide_v1(p_run text, p_keys text[], p_actor text, p_by text, p_reason text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    targets text[];
    r record;
    m record;
    verdict text;
    run_row record;
    readied int := 0;
BEGIN
    -- the tasks and their children (by each row's children: a map's child has no edges)
    targets := ARRAY(
        SELECT DISTINCT k FROM (
            SELECT unnest(p_keys) AS k
            UNION SELECT c.k FROM orc_tasks t, json_array_elements_text(coalesce(t.children, '[]'::json)) AS c(k)
                  WHERE t.run_id = p_run AND t.key = ANY (p_keys)
        ) AS x ORDER BY k);
    -- counted again from the parents: an expanded map counts as its children (relevant
    -- upstream), a chained map's child has its item's task as its parent, another map's child
    -- none (its map's parents were done when it was made)
    WITH tk AS (
        SELECT t.key, t.map_parent, t.map_item_from FROM orc_tasks t
        WHERE t.run_id = p_run AND t.key = ANY (targets) AND t.state = 'PENDING'
    ), par AS (
        SELECT tk.key AS child, e.parent_key AS parent FROM tk
        JOIN orc_edges e ON e.run_id = p_run AND e.child_key = tk.key WHERE tk.map_parent IS NULL
        UNION ALL SELECT tk.key, tk.map_item_from FROM tk WHERE tk.map_item_from IS NOT NULL
    ), units AS (
        SELECT par.child, p.state, p.role = 'setup' AS setup FROM par
        JOIN orc_tasks p ON p.run_id = p_run AND p.key = par.parent
        WHERE NOT (p.map_spec IS NOT NULL AND p.map_total > 0 AND p.state <> 'PENDING')
        UNION ALL
        SELECT par.child, c.state, false FROM par
        JOIN orc_tasks p ON p.run_id = p_run AND p.key = par.parent
        JOIN orc_tasks c ON c.run_id = p_run AND c.map_parent = p.key
        WHERE p.map_spec IS NOT NULL AND p.map_total > 0 AND p.state <> 'PENDING'
    ), sizes AS (
        SELECT par.child, sum(CASE WHEN p.map_spec IS NOT NULL AND p.map_total > 0 AND p.state <> 'PENDING'
                                   THEN p.map_total ELSE 1 END) AS n
        FROM par JOIN orc_tasks p ON p.run_id = p_run AND p.key = par.parent GROUP BY par.child
    ), x AS (
        SELECT tk.key, coalesce(z.n, 0) AS n,
               count(u.state) FILTER (WHERE u.state IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED')) AS done,
               count(u.state) FILTER (WHERE u.state = 'SUCCEEDED') AS ok,
               count(u.state) FILTER (WHERE u.state = 'FAILED') AS failed,
               count(u.state) FILTER (WHERE u.state = 'UPSTREAM_FAILED') AS upstream_failed,
               count(u.state) FILTER (WHERE u.state = 'SKIPPED') AS skipped,
               count(u.state) FILTER (WHERE u.state = 'SUCCEEDED' AND u.setup) AS setup_ok,
               count(u.state) FILTER (WHERE u.state = 'SKIPPED' AND u.setup) AS setup_skipped
        FROM tk LEFT JOIN units u ON u.child = tk.key LEFT JOIN sizes z ON z.child = tk.key
        GROUP BY tk.key, z.n
    )
    UPDATE orc_tasks c SET n_upstream = x.n,
        n_done = x.done, n_succeeded = x.ok, n_failed = x.failed, n_upstream_failed = x.upstream_failed,
        n_skipped = x.skipped, n_setup_ok = x.setup_ok, n_setup_skipped = x.setup_skipped
    FROM x WHERE c.run_id = p_run AND c.key = x.key AND c.state = 'PENDING';
    UPDATE orc_runs u SET open_tasks = (
        SELECT count(*) FROM orc_tasks t WHERE t.run_id = p_run
          AND t.state NOT IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED', 'CANCELLED'))
    WHERE u.id = p_run
    RETURNING u.state, u.open_tasks INTO run_row;
    IF run_row.state IN ('SUCCEEDED', 'FAILED') AND (run_row.open_tasks > 0 OR run_row.state <> CASE WHEN EXISTS (
            SELECT 1 FROM orc_tasks t WHERE t.run_id = p_run AND t.state IN ('FAILED', 'UPSTREAM_FAILED')
              AND t.decides_run) THEN 'FAILED' ELSE 'SUCCEEDED' END) THEN
        -- reopened: tasks to run again, or an outcome that a mark changed (closed again below)
        UPDATE orc_runs SET state = 'RUNNING', finished_at = NULL WHERE id = p_run;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, NULL, 0, run_row.state, 'RUNNING', p_actor, p_by, p_reason, true, now());
    END IF;
    FOR r IN SELECT t.key, t.trigger_rule, t.n_upstream, t.n_done, t.n_succeeded, t.n_failed, t.n_upstream_failed,
                    t.n_skipped, t.n_setup, t.n_setup_ok, t.n_setup_skipped, t.min_success_ratio,
                    t.map_spec IS NOT NULL AS mapped
             FROM orc_tasks t WHERE t.run_id = p_run AND t.key = ANY (targets) AND t.state = 'PENDING'
             ORDER BY t.key LOOP
        verdict := CASE WHEN r.n_upstream = 0 OR r.trigger_rule = 'always' THEN 'READY'
                        ELSE orc_decide_v2(r.trigger_rule, r.n_upstream, r.n_done, r.n_succeeded, r.n_failed,
                                           r.n_upstream_failed, r.n_skipped, r.n_setup, r.n_setup_ok,
                                           r.n_setup_skipped, r.min_success_ratio) END;
        CONTINUE WHEN verdict IS NULL;
        -- a branch that was not cleared keeps its choice: a child it did not follow is skipped again
        IF EXISTS (SELECT 1 FROM orc_edges e JOIN orc_tasks p ON p.run_id = e.run_id AND p.key = e.parent_key
                   WHERE e.run_id = p_run AND e.child_key = r.key AND p.flow = 'branch' AND p.state = 'SUCCEEDED'
                     AND NOT (p.result::jsonb = to_jsonb(r.key)
                              OR (jsonb_typeof(p.result::jsonb) = 'array' AND p.result::jsonb ? r.key))) THEN
            UPDATE orc_tasks t SET state = 'SKIPPED', finished_at = now(), skip_reason = 'branch_not_taken'
            WHERE t.run_id = p_run AND t.key = r.key AND t.state = 'PENDING'
            RETURNING t.key, t.attempt, t.children INTO m;
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            VALUES (p_run, m.key, m.attempt, 'PENDING', 'SKIPPED', p_actor, p_by,
                    'branch_not_taken: its branch keeps its choice (' || p_reason || ')', true, now());
            readied := readied + orc_settle_v2(p_run, m.key, 'SKIPPED', m.children, p_actor, p_by);
            CONTINUE;
        END IF;
        IF verdict = 'READY' AND r.mapped THEN
            m := NULL;
            SELECT (orc_expand_v1(p_run, r.key, p_actor, p_by, p_reason)) AS x INTO m;
            IF m.x IS NOT NULL AND m.x->>'state' <> 'MAPPED' THEN
                readied := readied + orc_settle_v2(p_run, r.key, m.x->>'state', m.x->'children', p_actor, p_by);
            ELSIF m.x IS NOT NULL THEN
                readied := readied + (m.x->>'readied')::int;
            END IF;
            CONTINUE;
        END IF;
        UPDATE orc_tasks t SET state = verdict,
            ready_at = CASE WHEN verdict = 'READY' THEN now() ELSE t.ready_at END,
            finished_at = CASE WHEN verdict = 'READY' THEN NULL ELSE now() END,
            skip_reason = CASE WHEN verdict = 'SKIPPED' THEN 'upstream_skipped' END
        WHERE t.run_id = p_run AND t.key = r.key AND t.state = 'PENDING'
        RETURNING t.key, t.attempt, t.children INTO m;
        CONTINUE WHEN NOT FOUND;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, m.key, m.attempt, 'PENDING', verdict, p_actor, p_by, p_reason, true, now());
        IF verdict = 'READY' THEN
            readied := readied + 1;
        ELSE
            readied := readied + orc_settle_v2(p_run, m.key, verdict, m.children, p_actor, p_by);
        END IF;
    END LOOP;
    -- nothing left open (every task it decided ended): close the run as settlement would
    SELECT state, open_tasks INTO run_row FROM orc_runs WHERE id = p_run;
    IF run_row.state = 'RUNNING' AND run_row.open_tasks <= 0 THEN
        UPDATE orc_runs SET state = CASE WHEN EXISTS (
                SELECT 1 FROM orc_tasks t WHERE t.run_id = p_run AND t.state IN ('FAILED', 'UPSTREAM_FAILED')
                  AND t.decides_run) THEN 'FAILED' ELSE 'SUCCEEDED' END,
            finished_at = now()
        WHERE id = p_run
        RETURNING state INTO verdict;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, NULL, 0, 'RUNNING', verdict, p_actor, p_by, p_reason || '; nothing left to run', true, now());
    END IF;
    RETURN readied;
END
$$;

-- The names earlier releases call, for their workers still running during a rolling upgrade:
-- each is a shim over the function that now does the work. The _v1 functions that 0011 replaced
-- (orc_claim_v1, orc_succeed_v1, orc_settle_v1; orc_decide_v1 is dropped: only settlement
-- called it) keep their signatures; the unversioned names of migrations 0004 to 0006 are the
-- four that the release before the versioned functions called from Python. Drop them when no
-- such worker is left (a later migration).

CREATE OR REPLACE FUNCTION orc_claim_v1(p_run text, p_key text, p_attempt integer, p_worker text,
    p_lease double precision, p_task text)
 RETURNS json
 LANGUAGE sql
AS $$
SELECT orc_claim_v2(p_run, p_key, p_attempt, p_worker, p_lease, p_task)
$$;

CREATE OR REPLACE FUNCTION orc_succeed_v1(p_run text, p_key text, p_attempt integer, p_result json,
    p_window integer, p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE sql
AS $$
-- that release knows no "invalid" answer (a branch's or a map parent's result its node cannot
-- use): it gets it as a conflict, and the attempt is recovered when its lease runs out
SELECT CASE WHEN r->>'invalid' IS NULL THEN r
            ELSE json_build_object('accepted', false, 'conflict', r->>'invalid') END
FROM orc_succeed_v2(p_run, p_key, p_attempt, p_result, p_window, p_worker_ttl, p_depth, p_aging) AS r
$$;

CREATE OR REPLACE FUNCTION orc_settle_v1(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text)
 RETURNS integer
 LANGUAGE sql
AS $$
SELECT orc_settle_v2(p_run, p_key, p_state, p_children, p_actor, p_by)
$$;

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
