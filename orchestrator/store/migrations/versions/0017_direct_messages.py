"""Direct messages: a task whose message carries all its body gets starts before its claim, and a
body that finishes within the worker's claim delay commits its claim and its success in one
statement (``orc_claim_succeed_v1``): one transaction per short task instead of two.

The admission's functions return whether each message is direct (``orc_admit_from_v2``,
``orc_pass_slot_v2``, ``orc_admit_v2``: no upstream results, map item, sensor or resumed state);
``orc_dispatch_v1`` returns it in each dispatch; the ``_v1`` admission functions stay as shims
for the previous release's workers (``legacy.sql``).

Revision ID: 0017
Revises: 0016
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(SQL)


def downgrade() -> None:
    op.execute(OLD_SQL)


#: store/sql/admit_from.sql, pass_slot.sql, admit.sql, claim.sql, succeed.sql and legacy.sql as
#: this revision installs them (frozen: a later change is a later migration)
SQL = r"""
-- orc_admit_from_v2: up to p_room READY tasks of p_queues -> QUEUED, one pick at a time.
--
-- Each pick is the best head: of each tenant's READY tasks in each queue the first (priority,
-- then age); among the heads the highest class (a task READY for p_aging seconds counts one
-- class higher, twice as long two), then the tenant furthest below its weighted share of the
-- tasks in flight on these queues, then round robin (last_admitted_at), then the oldest. A pick
-- that a limit holds back (orc_limit_held_v1) is set aside with its tenant, run, pool or rate
-- limit and the next head is looked at: a held pick uses no room, and a pass looks at most
-- p_room + 1000 times (a backlog too big for its pool's free slots is passed over 1,000 at a
-- time per pass, not all of it). Each row says whether its message is direct: the message's
-- arguments are all the body gets (no upstream results, map item, sensor or resumed state), so a
-- worker may start the body before claiming (orc_claim_succeed_v1).

CREATE OR REPLACE FUNCTION orc_admit_from_v2(p_queues text[], p_room integer, p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone, direct boolean)
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
                      t.soft_time_limit, t.time_limit, t.priority_rank::int, t.ready_at,
                      NOT t.wants_upstream AND t.map_item_from IS NULL AND t.wait_spec IS NULL
                          AND t.wait_resume IS NULL
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

-- orc_pass_slot_v2: a completion that made nothing READY hands its worker's slots on, in batches.
--
-- When the worker's group (p_queues, its queues as JSON text) is down to one message per slot
-- in flight (capacity x (p_depth - 1) below its capacity x p_depth; with a depth of 1, one slot
-- free), it is filled again to capacity x p_depth with the best READY tasks of those queues
-- (orc_admit_from_v2), without the admission lock unless a limit applies: no scan of other
-- queues, no waiting behind admissions, and one admission per batch of completions instead of
-- one per completion.

CREATE OR REPLACE FUNCTION orc_pass_slot_v2(p_queues text, p_worker_ttl double precision, p_depth integer,
    p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone, direct boolean)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
#variable_conflict use_column
DECLARE
    qs text[] := ARRAY(SELECT json_array_elements_text(p_queues::json));
    capacity int;
    used int;
    room int;
BEGIN
    SELECT coalesce(sum(w.concurrency), 0)::int INTO capacity FROM orc_workers w
    WHERE w.queues::text = p_queues AND w.seen_at > now() - make_interval(secs => p_worker_ttl);
    SELECT coalesce(sum((SELECT count(*) FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
        CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t WHERE t.queue = q.name AND t.state = s.state
            AND t.state IN ('QUEUED', 'RUNNING')
            ORDER BY t.queue, t.state, t.tenant, t.priority_rank, t.ready_at LIMIT 1000000000) AS i)), 0)::int
                INTO used FROM unnest(qs) AS q(name);
    room := capacity * p_depth - used;
    IF room < greatest(capacity * (p_depth - 1), 1) THEN
        RETURN;
    END IF;
    IF room > 1 THEN
        -- a batch: counted again under the admission lock, so that two completions handing
        -- slots on at once never fill the same room twice (the second sees the first's
        -- admissions once it commits); a single slot is replaced without it (only its own)
        PERFORM pg_advisory_xact_lock(1869767425);
        SELECT coalesce(sum((SELECT count(*) FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
            CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t WHERE t.queue = q.name AND t.state = s.state
                AND t.state IN ('QUEUED', 'RUNNING')
                ORDER BY t.queue, t.state, t.tenant, t.priority_rank, t.ready_at LIMIT 1000000000) AS i)), 0)::int
                    INTO used FROM unnest(qs) AS q(name);
        room := capacity * p_depth - used;
        IF room <= 0 THEN
            RETURN;
        END IF;
    END IF;
    RETURN QUERY SELECT * FROM orc_admit_from_v2(qs, room, p_aging);
END
$$;

-- orc_admit_v2: READY -> QUEUED within the live workers' capacity, in fair order.
--
-- Serialized by the admission lock (advisory transaction lock 1869767425): p_wait = true waits
-- for it (a completion, a submit), false returns nothing while another admission holds it (the
-- reconciler). For each group of live workers consuming the same queues, the room is their
-- concurrency x p_depth less the tasks in flight on those queues, and at most p_window tasks
-- are in flight in all; orc_admit_from_v2 fills the room. Returns the rows to publish after
-- the caller commits.

CREATE OR REPLACE FUNCTION orc_admit_v2(p_window integer, p_worker_ttl double precision, p_depth integer,
    p_wait boolean, p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone, direct boolean)
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
        RETURN QUERY SELECT * FROM orc_admit_from_v2(qs, room, p_aging);
        GET DIAGNOSTICS n = ROW_COUNT;
        total := total + n;
    END LOOP;
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
-- of the same key's child of the map before it, as its mapped keyword. A sensor's claim adds
-- "sensor" (its polling spec), a deferred body's called again "resumed" (orc_wake_v1).

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
    RETURNING t.args, t.kwargs, t.wants_upstream, t.map_parent, t.map_item_from, t.wait_spec, t.wait_resume INTO row;
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
    IF row.wait_spec IS NOT NULL OR row.wait_resume IS NOT NULL THEN
        -- a sensor's polling, and what a body called again after it deferred gets
        RETURN json_build_object('claimed', true, 'args', row.args, 'kwargs', kwargs,
                                 'wants_upstream', row.wants_upstream, 'upstream', coalesce(upstream, '{}'::json),
                                 'sensor', row.wait_spec, 'resumed', row.wait_resume);
    END IF;
    RETURN json_build_object('claimed', true, 'args', row.args, 'kwargs', kwargs,
                             'wants_upstream', row.wants_upstream, 'upstream', coalesce(upstream, '{}'::json));
END
$$;

-- orc_claim_succeed_v1: the claim folded into the success, for a direct message (its arguments
-- are all the body gets: orc_admit_from_v2's direct flag) whose body finished before its worker's
-- claim delay (ORCHESTRATOR_CLAIM_DELAY). One statement: QUEUED -> RUNNING for p_attempt with
-- its ledger row, both stamped when the body started (p_elapsed seconds ago, not before the
-- task was dispatched), then orc_succeed_v2. The claim's
-- conditions are orc_claim_v2's plus the direct ones; a claim that loses writes the rejected
-- event and returns {"accepted": false, "conflict"} (the body's result is dropped, never
-- committed), otherwise what orc_succeed_v2 returns.

CREATE OR REPLACE FUNCTION orc_claim_succeed_v1(p_run text, p_key text, p_attempt integer, p_worker text,
    p_task text, p_elapsed double precision, p_result json, p_window integer, p_worker_ttl double precision,
    p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    conflict text;
    began timestamptz;
BEGIN
    UPDATE orc_tasks t SET state = 'RUNNING', heartbeat_at = now(), worker = p_worker,
                           started_at = least(greatest(now() - make_interval(secs => greatest(p_elapsed, 0)),
                                                       coalesce(t.dispatched_at, now())), now())
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'QUEUED' AND t.attempt = p_attempt
      AND t.task_name = p_task AND NOT t.wants_upstream AND t.map_item_from IS NULL AND t.wait_spec IS NULL
      AND t.wait_resume IS NULL
    RETURNING t.started_at INTO began;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'RUNNING', 'worker',
                                  'claim by ' || p_worker || ' for a message of ' || p_task);
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'QUEUED', 'RUNNING', 'worker', NULL, 'claim by ' || p_worker, true, began);
    RETURN orc_succeed_v2(p_run, p_key, p_attempt, p_result, p_window, p_worker_ttl, p_depth, p_aging);
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
-- (orc_pass_slot_v2); otherwise the whole admission runs (orc_admit_v2).

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
            FROM orc_pass_slot_v2(group_queues, p_worker_ttl, p_depth, p_aging) d;
            RETURN dispatches;
        END IF;
    END IF;
    SELECT coalesce(json_agg(d ORDER BY d.priority_rank, d.ready_at), '[]'::json) INTO dispatches
    FROM orc_admit_v2(p_window, p_worker_ttl, p_depth, true, p_aging) d;
    RETURN dispatches;
END
$$;

-- The names earlier releases call, for their workers still running during a rolling upgrade:
-- each is a shim over the function that now does the work. The _v1 functions that 0011 replaced
-- (orc_claim_v1, orc_succeed_v1, orc_settle_v1; orc_decide_v1 is dropped: only settlement
-- called it) keep their signatures; so do the _v1 functions of clear.sql that 0014 replaced
-- (orc_clear_v1, orc_mark_v1 for the previous release's operator commands and web page, and
-- orc_redecide_v1 that they called); the admission's _v1 functions that 0017 replaced
-- (orc_admit_v1, orc_admit_from_v1, orc_pass_slot_v1: their rows without the direct flag); the
-- unversioned names of migrations 0004 to 0006 are the
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

CREATE OR REPLACE FUNCTION orc_clear_v1(p_run text, p_keys text[], p_actor text, p_by text, p_reason text)
 RETURNS integer
 LANGUAGE sql
AS $$
SELECT orc_clear_v2(p_run, p_keys, p_actor, p_by, p_reason)
$$;

CREATE OR REPLACE FUNCTION orc_mark_v1(p_run text, p_key text, p_state text, p_actor text, p_by text)
 RETURNS text
 LANGUAGE sql
AS $$
SELECT orc_mark_v2(p_run, p_key, p_state, p_actor, p_by)
$$;

CREATE OR REPLACE FUNCTION orc_redecide_v1(p_run text, p_keys text[], p_actor text, p_by text, p_reason text)
 RETURNS integer
 LANGUAGE sql
AS $$
SELECT orc_redecide_v2(p_run, p_keys, p_actor, p_by, p_reason)
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

CREATE OR REPLACE FUNCTION orc_admit_from_v1(p_queues text[], p_room integer, p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone)
 LANGUAGE sql
AS $$
SELECT run_id, key, attempt, task_name, args, kwargs, queue, soft_time_limit, time_limit, priority_rank, ready_at
FROM orc_admit_from_v2(p_queues, p_room, p_aging)
$$;

CREATE OR REPLACE FUNCTION orc_pass_slot_v1(p_queues text, p_worker_ttl double precision, p_depth integer,
    p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone)
 LANGUAGE sql
AS $$
SELECT run_id, key, attempt, task_name, args, kwargs, queue, soft_time_limit, time_limit, priority_rank, ready_at
FROM orc_pass_slot_v2(p_queues, p_worker_ttl, p_depth, p_aging)
$$;

CREATE OR REPLACE FUNCTION orc_admit_v1(p_window integer, p_worker_ttl double precision, p_depth integer,
    p_wait boolean, p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone)
 LANGUAGE sql
AS $$
SELECT run_id, key, attempt, task_name, args, kwargs, queue, soft_time_limit, time_limit, priority_rank, ready_at
FROM orc_admit_v2(p_window, p_worker_ttl, p_depth, p_wait, p_aging)
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

#: what 0016 installed (the _v1 admission functions, orc_dispatch_v1 calling them), then the
#: new functions dropped
OLD_SQL = r"""
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

DROP FUNCTION orc_claim_succeed_v1(text, text, integer, text, text, double precision, json, integer,
    double precision, integer, double precision);
DROP FUNCTION orc_admit_v2(integer, double precision, integer, boolean, double precision);
DROP FUNCTION orc_pass_slot_v2(text, double precision, integer, double precision);
DROP FUNCTION orc_admit_from_v2(text[], integer, double precision);
"""
