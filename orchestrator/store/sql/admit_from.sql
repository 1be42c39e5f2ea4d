-- orc_admit_from_v2: up to p_room READY tasks of p_queues -> QUEUED, one pick at a time.
--
-- Each pick is the best head: of each tenant's READY tasks in each queue the first (priority,
-- then age); among the heads the highest class (a task READY for p_aging seconds counts one
-- class higher, twice as long two), then a tenant within its share of the group's window (its
-- tasks in flight on these queues at most one above window x weight / the heads' weights), then
-- the tenant furthest behind in weighted admissions here (start-time fair queueing: each pick
-- moves its tenant's finish tag to its start tag + 1 / weight, and the smallest start tag goes
-- next; the start tag is max(finish tag, the group's virtual time less the tenant's shortfall
-- below its share of the window over its weight), so a tenant that comes back catches up to its
-- share of the window and no more; orc_admission_shares), then round robin (the tenant picked
-- longest ago here), then the oldest. Within
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
-- wrote) nothing changed. Only contested picks (several tenants' heads) read or write the shares:
-- one row per tenant and group of queues (p_queues as text), so admissions of other groups never
-- wait for its rows.

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
    group_key text := p_queues::text;
    tags jsonb;
    vtime float8 := 0;
    turns bigint := 0;
    win int;
    start_tag float8;
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
               h.priority_rank AS rank, w.max_running AS tenant_limit, coalesce(w.weight, 1.0) AS weight,
               sum(coalesce(w.weight, 1.0)) OVER () AS weights,
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
                 coalesce((loads ->> h.tenant)::int, 0)
                     > ceil(win * coalesce(w.weight, 1.0) / sum(coalesce(w.weight, 1.0)) OVER ()),
                 greatest((tags -> h.tenant ->> 0)::float8,
                          vtime - greatest(win * coalesce(w.weight, 1.0) / sum(coalesce(w.weight, 1.0)) OVER ()
                                           - coalesce((loads ->> h.tenant)::int, 0), 0) / coalesce(w.weight, 1.0)),
                 (tags -> h.tenant ->> 1)::bigint NULLS FIRST,
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
            -- and their finish tags here, with the group's virtual time and pick count (the row
            -- of tenant ''). The order between tenants within their share of the window is by
            -- weighted admissions, not by tasks in flight alone: read at the instants slots free
            -- (a batch of hand-offs fills several), the tenant whose tasks just ended looked short
            -- of its share, and weights 3:1 got 2.2-2.6:1 of the slots
            SELECT coalesce(jsonb_object_agg(a.tenant, jsonb_build_array(a.finish, a.turn))
                                FILTER (WHERE a.tenant <> ''), '{}'::jsonb),
                   coalesce(max(a.finish) FILTER (WHERE a.tenant = ''), 0),
                   coalesce(max(a.turn) FILTER (WHERE a.tenant = ''), 0)
                INTO tags, vtime, turns
            FROM orc_admission_shares a WHERE a.queues = group_key;
            -- the group's window: its tasks in flight and the room
            SELECT coalesce(sum(v.n::int), 0) + p_room INTO win FROM jsonb_each_text(loads) AS v(tenant, n);
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
        IF pick.contested AND tags IS NOT NULL THEN
            -- the pick's start tag (as ordered above, with its tasks in flight before it), finish
            -- tag and turn (round robin between tenants with equal start tags: the one picked
            -- longest ago first); the virtual time never goes back
            turns := turns + 1;
            start_tag := greatest((tags -> pick.tenant ->> 0)::float8,
                                  vtime - greatest(win * pick.weight / pick.weights
                                                   - coalesce((loads ->> pick.tenant)::int, 0), 0) / pick.weight);
            vtime := greatest(vtime, start_tag);
            tags := jsonb_set(tags, ARRAY[pick.tenant::text],
                              jsonb_build_array(start_tag + 1.0 / pick.weight, turns), true);
            INSERT INTO orc_admission_shares AS a (queues, tenant, finish, turn)
            VALUES (group_key, pick.tenant, start_tag + 1.0 / pick.weight, turns)
            ON CONFLICT (queues, tenant) DO UPDATE SET finish = excluded.finish, turn = excluded.turn;
        END IF;
        IF rloads IS NOT NULL THEN
            rloads := jsonb_set(rloads, ARRAY[pick.run_id::text],
                                to_jsonb(coalesce((rloads ->> pick.run_id)::int, 0) + 1), true);
        END IF;
        IF loads IS NOT NULL THEN
            loads := jsonb_set(loads, ARRAY[pick.tenant::text],
                               to_jsonb(coalesce((loads ->> pick.tenant)::int, 0) + 1), true);
        END IF;
    END LOOP;
    IF tags IS NOT NULL THEN
        INSERT INTO orc_admission_shares AS a (queues, tenant, finish, turn) VALUES (group_key, '', vtime, turns)
        ON CONFLICT (queues, tenant) DO UPDATE SET finish = excluded.finish, turn = excluded.turn;
    END IF;
END
$$;
