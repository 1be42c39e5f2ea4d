"""Transactional tasks (``dag.task(..., transactional=True)``): ``orc_tasks.transactional``.

A transactional task's body runs in the transaction that commits its success (the worker opens it
and runs ``orc_succeed_v2`` in it: ``store/transactional.py``). Four functions are changed in
place, their meaning for every task an earlier release makes unchanged (the column is null on
each of them, and only this release writes it):

- ``orc_claim_v2`` returns ``"transactional": true`` for such a task (a key an old worker never
  meets, since only this release submits one);
- ``orc_admit_from_v2`` never marks such a task's message direct (its body must not start before
  its claim, outside its transaction);
- ``orc_claim_succeed_v1`` refuses such a task (a direct body's claim folded into its success);
- ``orc_map_insert_v1`` makes a transactional map's children transactional.

The column is nullable with no default: adding it rewrites no row. A worker of the previous
release that claims such a task mid-upgrade runs its body without ``current_context().transaction``
(an ``AttributeError`` where the body reaches for it: the attempt fails and is retried), so the
body's writes are never made outside a transaction.

Revision ID: 0032
Revises: 0031
"""

import importlib
import re

import sqlalchemy as sa
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("orc_tasks", sa.Column("transactional", sa.Boolean, nullable=True))
    op.execute(SQL)


def downgrade() -> None:
    # orc_claim_v2 and orc_claim_succeed_v1 as 0017 installed them, orc_admit_from_v2 as 0027 did,
    # orc_map_insert_v1 as 0026 did (no revision between changed them)
    for module, name in (
        ("0017_direct_messages", "orc_claim_v2"),
        ("0017_direct_messages", "orc_claim_succeed_v1"),
        ("0027_runs_share_admission", "orc_admit_from_v2"),
        ("0026_mapping_forms", "orc_map_insert_v1"),
    ):
        text = importlib.import_module(f"orchestrator.store.migrations.versions.{module}").SQL
        found = re.search(rf"CREATE OR REPLACE FUNCTION {name}\(.*?\n\$\$;\n", text, re.S)
        assert found is not None, name
        op.execute(found.group(0))
    op.drop_column("orc_tasks", "transactional")


#: orc_claim_v2 and orc_claim_succeed_v1 of store/sql/claim.sql, orc_admit_from_v2 of
#: store/sql/admit_from.sql, orc_map_insert_v1 of store/sql/expand.sql, as this revision installs
#: them (frozen: a later change is a later migration)
SQL = r"""
-- orc_claim_v2: a worker's claim, QUEUED -> RUNNING for p_attempt, with the lease.
--
-- The attempt is the fencing token and the message's task name must be the node's. Returns
-- {"claimed": true, "args", "kwargs", "wants_upstream", "upstream"} (upstream: the results of
-- the parents that succeeded, for tasks that want them; a mapped parent's is the list of its
-- children's results in map order, those that succeeded; a child of a map has its map's
-- parents) or {"claimed": false, "conflict"} with the rejected event written (nothing is
-- written for an unknown task). A child of a map mapped item by item gets its item, the result
-- of the same key's child of the map before it, as its mapped keyword. A sensor's claim adds
-- "sensor" (its polling spec), a deferred body's called again "resumed" (orc_wake_v1), a
-- transactional task's (orc_tasks.transactional) "transactional": true.

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
    RETURNING t.args, t.kwargs, t.wants_upstream, t.map_parent, t.map_item_from, t.wait_spec, t.wait_resume,
              t.transactional INTO row;
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
    IF row.transactional THEN
        -- its body runs in the transaction that commits its success (the worker opens it)
        RETURN json_build_object('claimed', true, 'args', row.args, 'kwargs', kwargs,
                                 'wants_upstream', row.wants_upstream, 'upstream', coalesce(upstream, '{}'::json),
                                 'transactional', true);
    END IF;
    RETURN json_build_object('claimed', true, 'args', row.args, 'kwargs', kwargs,
                             'wants_upstream', row.wants_upstream, 'upstream', coalesce(upstream, '{}'::json));
END
$$;

-- orc_claim_succeed_v1: the claim folded into the success, for a direct message (its arguments
-- are all the body gets: orc_admit_from_v2's direct flag) whose body finished before its worker's
-- claim delay (ORCHESTRATOR_CLAIM_DELAY). One statement: QUEUED -> RUNNING for p_attempt with
-- its ledger row, both stamped when the body started (p_elapsed seconds ago, not before the
-- task was dispatched), then orc_succeed_v2. The claim's conditions are orc_claim_v2's plus
-- the direct ones (a transactional task is never direct); a claim that loses writes the rejected
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
      AND t.wait_resume IS NULL AND t.transactional IS NOT TRUE
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

-- orc_admit_from_v2: up to p_room READY tasks of p_queues -> QUEUED, one pick at a time.
--
-- Each pick is the best head: of each tenant's READY tasks in each queue the first (priority,
-- then age); among the heads the highest class (a task READY for p_aging seconds counts one
-- class higher, twice as long two), then the tenant furthest below its weighted share of the
-- tasks in flight on these queues, then round robin (last_admitted_at), then the oldest. Within
-- the tenant, runs share too: when another of its runs has READY tasks of the pick's queue and
-- class, the run with the fewest tasks in flight on these queues goes first (the first one found
-- with none; at most 16 runs looked at, from the oldest head's run on, in run id order), its
-- oldest task of that class, so a small run is not queued behind a big map's backlog. A pick
-- that a limit holds back (orc_limit_held_v2) is set aside with its tenant, run, pool, rate
-- limit or breaker (its resource) and the next head is looked at: a held pick uses no room, and a pass looks at most
-- p_room + 1000 times (a backlog too big for its pool's free slots is passed over 1,000 at a
-- time per pass, not all of it). A task whose name no live worker of its queue registered
-- (orc_worker_tasks), or that a worker dropped as unregistered (dropped_by), is not looked at:
-- it waits READY, and the reconciler's watchdog flags it. Each row says whether its message is
-- direct: the message's arguments are all the body gets (no upstream results, map item, sensor
-- or resumed state; never a transactional task's), so a worker may start the body before claiming
-- (orc_claim_succeed_v1). A task admitted with
-- resources takes its half-open breakers' probe permits and counts in their ramps' waves
-- (orc_breaker_admitted_v1); for a task without resources (every task an earlier release
-- wrote) nothing changed.

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
    held_breakers text[] := '{}';
    why text;
    taken int := 0;
    looks int := 0;
    n int;
    rloads jsonb;
    best text;
    best_load int;
    cur text;
    nxt text;
    wrapped boolean;
    alt record;
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
        SELECT h.run_id, h.key, h.tenant, h.pool, h.pool_slots, h.rate_limit, h.resources, h.queue,
               h.priority_rank AS rank, w.max_running AS tenant_limit,
               min(h.tenant) OVER () <> max(h.tenant) OVER () AS contested INTO pick
        FROM tq
        CROSS JOIN LATERAL (
            SELECT p.run_id, p.key, p.tenant, p.priority_rank, p.ready_at, p.pool, p.pool_slots, p.rate_limit,
                   p.resources, p.queue
            FROM orc_tasks p
            WHERE p.queue = tq.queue AND p.state = 'READY' AND p.tenant = tq.tenant
              AND NOT ((p.run_id || '/' || p.key) = ANY (skipped))
              AND NOT (p.run_id = ANY (held_runs))
              AND (p.pool IS NULL OR NOT (p.pool = ANY (held_pools)))
              AND (p.rate_limit IS NULL OR NOT (p.rate_limit = ANY (held_rates)))
              AND (p.resources IS NULL OR NOT (p.resources && held_breakers))
              -- a task no live worker of its queue has registered waits READY (one probe of the
              -- small orc_worker_tasks per row looked at, in this statement), and one a worker
              -- dropped as unregistered until a worker that has it registers (orc_tasks.dropped_by)
              AND p.dropped_by IS NULL
              AND EXISTS (SELECT 1 FROM orc_worker_tasks k
                          WHERE k.queue = p.queue AND k.task_name IN (p.task_name, '*'))
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
        IF EXISTS (SELECT 1 FROM orc_tasks o WHERE o.queue = pick.queue AND o.state = 'READY'
                       AND o.tenant = pick.tenant AND o.priority_rank = pick.rank AND o.run_id < pick.run_id)
           OR EXISTS (SELECT 1 FROM orc_tasks o WHERE o.queue = pick.queue AND o.state = 'READY'
                          AND o.tenant = pick.tenant AND o.priority_rank = pick.rank AND o.run_id > pick.run_id) THEN
            -- runs of the tenant compete: the one with the fewest tasks in flight goes first
            IF rloads IS NULL THEN
                SELECT coalesce(jsonb_object_agg(f.run_id, f.n), '{}'::jsonb) INTO rloads
                FROM (
                    SELECT i.run_id, count(*) AS n
                    FROM unnest(p_queues) AS q(name)
                    CROSS JOIN LATERAL unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
                    CROSS JOIN LATERAL (
                        SELECT t.run_id FROM orc_tasks t WHERE t.queue = q.name AND t.state = s.state
                            AND t.state IN ('QUEUED', 'RUNNING')
                        ORDER BY t.queue, t.state, t.tenant, t.priority_rank, t.ready_at LIMIT 1000000000
                    ) AS i
                    GROUP BY i.run_id
                ) AS f;
            END IF;
            best := pick.run_id;
            best_load := coalesce((rloads ->> pick.run_id)::int, 0);
            cur := pick.run_id;
            wrapped := false;
            FOR i IN 1..16 LOOP
                EXIT WHEN best_load = 0;
                SELECT o.run_id INTO nxt FROM orc_tasks o
                WHERE o.queue = pick.queue AND o.state = 'READY' AND o.tenant = pick.tenant
                  AND o.priority_rank = pick.rank AND o.run_id > cur
                ORDER BY o.run_id LIMIT 1;
                IF NOT FOUND THEN
                    EXIT WHEN wrapped;
                    wrapped := true;
                    cur := '';
                    CONTINUE;
                END IF;
                EXIT WHEN nxt = pick.run_id;
                cur := nxt;
                CONTINUE WHEN nxt = ANY (held_runs);
                IF coalesce((rloads ->> nxt)::int, 0) < best_load THEN
                    best := nxt;
                    best_load := coalesce((rloads ->> nxt)::int, 0);
                END IF;
            END LOOP;
            IF best <> pick.run_id THEN
                SELECT p.run_id, p.key, p.pool, p.pool_slots, p.rate_limit, p.resources INTO alt
                FROM orc_tasks p
                WHERE p.queue = pick.queue AND p.state = 'READY' AND p.tenant = pick.tenant
                  AND p.priority_rank = pick.rank AND p.run_id = best
                  AND NOT ((p.run_id || '/' || p.key) = ANY (skipped))
                  AND (p.pool IS NULL OR NOT (p.pool = ANY (held_pools)))
                  AND (p.rate_limit IS NULL OR NOT (p.rate_limit = ANY (held_rates)))
                  AND (p.resources IS NULL OR NOT (p.resources && held_breakers))
                  AND p.dropped_by IS NULL
                  AND EXISTS (SELECT 1 FROM orc_worker_tasks k
                              WHERE k.queue = p.queue AND k.task_name IN (p.task_name, '*'))
                ORDER BY p.ready_at LIMIT 1;
                IF FOUND THEN
                    pick.run_id := alt.run_id;
                    pick.key := alt.key;
                    pick.pool := alt.pool;
                    pick.pool_slots := alt.pool_slots;
                    pick.rate_limit := alt.rate_limit;
                    pick.resources := alt.resources;
                END IF;
            END IF;
        END IF;
        why := orc_limit_held_v2(pick.run_id, pick.tenant, pick.tenant_limit, pick.pool, pick.pool_slots,
                                 pick.rate_limit, pick.resources);
        IF why IS NOT NULL THEN
            CASE why
                WHEN 'tenant' THEN held_tenants := held_tenants || pick.tenant::text;
                WHEN 'run' THEN held_runs := held_runs || pick.run_id::text;
                WHEN 'pool' THEN held_pools := held_pools || pick.pool::text;
                WHEN 'rate' THEN held_rates := held_rates || pick.rate_limit::text;
                WHEN 'breaker' THEN
                    held_breakers := held_breakers || coalesce(orc_breaker_held_v1(pick.resources), pick.resources[1]);
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
                          AND t.wait_resume IS NULL AND t.transactional IS NOT TRUE
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
        IF pick.resources IS NOT NULL THEN
            -- a probe permit or a place in the ramp's wave (the admission lock is still held)
            PERFORM orc_breaker_admitted_v1(pick.run_id, pick.key, pick.resources);
        END IF;
        IF pick.rate_limit IS NOT NULL THEN
            -- the token (orc_limit_held found one under the admission lock, which is still held)
            UPDATE orc_rate_limits l
            SET tokens = least(l.burst, l.tokens
                               + l.rate * greatest(extract(epoch FROM clock_timestamp() - l.refilled_at), 0)) - 1,
                refilled_at = clock_timestamp()
            WHERE l.key = pick.rate_limit;
        END IF;
        IF rloads IS NOT NULL THEN
            rloads := jsonb_set(rloads, ARRAY[pick.run_id::text],
                                to_jsonb(coalesce((rloads ->> pick.run_id)::int, 0) + 1), true);
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

-- orc_map_insert_v1: the rows of one expansion (orc_expand_v1's) or of one more window of it
-- (orc_map_window_v1's). p_items is the slice [{"k", "kw"}] that starts at map index p_offset of
-- p_total items; p_item_of, for a node mapped item by item, is the map whose child of the same
-- key holds each item (its result is passed at claim time). The first slice (p_offset 0) also
-- moves the node PENDING -> MAPPED with its total, widens its downstream's counters and grows
-- the run's task counts by p_total. Recurses into the nodes mapped item by item over this one,
-- with the same slice. Each child uses its node's resources (their circuit breakers) and is
-- transactional when its node is (orc_tasks.transactional). A node
-- expanded again (its map cleared with what it maps over: its attempt > 1, its old children
-- removed) never reuses an attempt of a key: each child's first attempt continues after the
-- highest one the ledger holds for its key in the run (one indexed look-up for the slice; a first
-- expansion skips it), and its max_attempts moves with it (the whole retry budget), so its
-- messages' Celery task ids <run>.<key>.<attempt> differ from every one an earlier generation
-- used (those the clear revoked too) and the claim's attempt fencing refuses their messages.
-- Returns how many children it made READY.

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
    prior jsonb := '{}'::jsonb;
BEGIN
    SELECT t.* INTO h FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    IF h.attempt > 1 THEN
        -- expanded again: the attempts each key used before (a removed child's are in the ledger)
        prior := (SELECT coalesce(jsonb_object_agg(e.key, e.top), '{}'::jsonb) FROM (
                      SELECT e.key, max(e.attempt) AS top FROM orc_task_events e
                      WHERE e.run_id = p_run AND e.accepted AND e.key IN (
                          SELECT p_key || '[' || (x->>'k') || ']' FROM jsonb_array_elements(p_items) AS a(x))
                      GROUP BY e.key) AS e);
    END IF;
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
        map_failed, map_skipped, resources, transactional)
    SELECT p_run, p_key || '[' || (x->>'k') || ']', h.task_name, h.args,
           CASE WHEN p_item_of IS NULL THEN (h.kwargs::jsonb || (x->'kw'))::json ELSE h.kwargs END,
           CASE WHEN o <= cap THEN 'READY' ELSE 'PENDING' END,
           1 + coalesce((prior->>(p_key || '[' || (x->>'k') || ']'))::int, 0),
           h.max_attempts + coalesce((prior->>(p_key || '[' || (x->>'k') || ']'))::int, 0), h.backoff, 'all_success',
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
           coalesce((h.map_spec->>'decides')::boolean, true), p_key, (p_offset + o - 1)::int, x->>'k',
           CASE WHEN p_item_of IS NULL THEN NULL ELSE p_item_of || '[' || (x->>'k') || ']' END, 0, 0, 0, 0, 0,
           h.resources, h.transactional
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(x, o);
    readied := LEAST(cap, n);
    IF readied > 0 THEN
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        SELECT p_run, p_key || '[' || (x->>'k') || ']',
               1 + coalesce((prior->>(p_key || '[' || (x->>'k') || ']'))::int, 0), 'PENDING', 'READY', p_actor, p_by,
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
"""
