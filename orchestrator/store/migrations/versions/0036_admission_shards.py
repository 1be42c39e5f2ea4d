"""Admission without a deployment-wide lock, and fair shares that hold with batched hand-offs.

**Locks per queue.** Admission took one advisory transaction lock (1869767425) for the whole
deployment: every admission (a submit's, a completion that made tasks READY, each batch of handed-on
slots, the reconciler's pass) waited for every other. Now each queue has its own admission lock
(``orc_admission_lock_v1``: key (1869767425, hashtext(queue)), taken in key order):
``orc_admit_v2`` locks the queues of the live groups that have READY work, all at once before it
counts, and admits each group whose queues it holds; ``orc_pass_slot_v2``'s batch locks its
group's queues. Two groups that share no queue never wait for each other; groups that share a
queue are serialised on it as before. The single-key lock 1869767425 stays the cross-group lock
of what spans groups (limits in ``orc_limit_held_v2``, the breakers), always taken after the
queues' locks. The window (at most ``p_window`` in flight in all) is counted after the locks from
what other groups committed: groups admitted at the same moment may pass it by what they admitted
meanwhile; each group's room (concurrency x depth) stays exact. (A batch of handed-on slots never
looked at the window.)

**Fair shares with batches.** The share a tenant gets (``orc_admit_from_v2``) was its tasks in
flight on the group's queues over its weight, read when slots free; a batch of hand-offs
(``orc_pass_slot_v2``, 0005/0014) fills two or more slots at once, at the moment the tasks that
just ended are gone from the count, and weights 3:1 got 2.2-2.75:1 of the admissions in
``bench/bench.py``'s scenario. Now a tenant within its weighted share of the group's window
(its tasks in flight) goes first, and among those the one furthest behind in weighted admissions
in the group (start-time fair queueing: start tag max(finish tag, virtual time - shortfall below
its share of the window / weight), finish tag start + 1 / weight; 3:1 reads 2.95-3.25).
``orc_admission_shares`` (new: group of queues, tenant, ``finish`` tag, ``turn``: the group's
pick count at its last pick; the group's virtual time in the row of tenant ``''``) also replaces
``orc_tenants.last_admitted_at`` for round robin: that row was updated by every group's
admissions, and is no longer written. Written only when several tenants compete, as before; rows
per group, so admissions of other groups never wait for them.

A worker of the previous release calls the same functions with the same arguments and results.

Revision ID: 0036
Revises: 0035
"""

import importlib
import re

import sqlalchemy as sa
from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "orc_admission_shares",
        sa.Column("queues", sa.Text, primary_key=True),
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("finish", sa.Float, nullable=False),
        sa.Column("turn", sa.BigInteger, nullable=False),
    )
    op.execute(SQL)


#: where each function changed here was last defined before this revision
_BEFORE = {"orc_admit_from_v2": "0032_transactional_tasks", "orc_pass_slot_v2": "0017_direct_messages",
           "orc_admit_v2": "0017_direct_messages"}  # fmt: skip


def downgrade() -> None:
    for name, module in _BEFORE.items():
        text = importlib.import_module(f"orchestrator.store.migrations.versions.{module}").SQL
        found = re.search(rf"CREATE OR REPLACE FUNCTION {name}\(.*?\n\$\$;\n", text, re.S)
        assert found is not None, f"{module} defines {name}"
        op.execute(found.group(0))
    op.execute("DROP FUNCTION orc_admission_lock_v1(text[], boolean)")
    op.drop_table("orc_admission_shares")


#: the functions of store/sql/admit_from.sql, pass_slot.sql and admit.sql this revision changes or
#: adds, as it installs them (frozen: a later change is a later migration)
SQL = r"""
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
    bench boolean;
    t0 timestamptz;
    t1 timestamptz;
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
        -- a batch: counted again under the group's admission locks, so that two completions
        -- handing slots on at once never fill the same room twice (the second sees the first's
        -- admissions once it commits); a single slot is replaced without them (only its own)
        bench := current_setting('orc.bench_locks', true) = 'on';
        IF bench THEN
            t0 := clock_timestamp();
        END IF;
        PERFORM orc_admission_lock_v1(qs, true);
        IF bench THEN
            t1 := clock_timestamp();
        END IF;
        SELECT coalesce(sum((SELECT count(*) FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state)
            CROSS JOIN LATERAL (SELECT 1 FROM orc_tasks t WHERE t.queue = q.name AND t.state = s.state
                AND t.state IN ('QUEUED', 'RUNNING')
                ORDER BY t.queue, t.state, t.tenant, t.priority_rank, t.ready_at LIMIT 1000000000) AS i)), 0)::int
                    INTO used FROM unnest(qs) AS q(name);
        room := capacity * p_depth - used;
        IF room > 0 THEN
            RETURN QUERY SELECT * FROM orc_admit_from_v2(qs, room, p_aging);
        END IF;
        IF bench THEN
            INSERT INTO orc_bench_locks (section, waited_us, held_us)
            VALUES ('pass_slot', extract(epoch FROM t1 - t0) * 1e6, extract(epoch FROM clock_timestamp() - t1) * 1e6);
        END IF;
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM orc_admit_from_v2(qs, room, p_aging);
END
$$;

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
    wanted text[];
    mine text[];
    total int;
    used int;
    room int;
    n int;
    bench boolean := current_setting('orc.bench_locks', true) = 'on';
    t0 timestamptz;
    t1 timestamptz;
BEGIN
    PERFORM 1 FROM orc_tasks t WHERE t.state = 'READY' LIMIT 1;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    -- count and admit as one step, per group: the queues of the live groups with READY work are
    -- locked first, all at once (a lock taken between two groups' admissions could wait for a
    -- transaction that waits for the first). A completion or a submit waits for them (held for
    -- a few statements that wait on nothing): skipping would leave the work it just made READY to
    -- the next tick when the holder's snapshot predates it. The reconciler does not wait.
    wanted := ARRAY(
        SELECT DISTINCT q.name
        FROM orc_workers w CROSS JOIN LATERAL json_array_elements_text(w.queues) AS q(name)
        WHERE w.seen_at > now() - make_interval(secs => p_worker_ttl)
          AND EXISTS (SELECT 1 FROM json_array_elements_text(w.queues) AS r(name)
                      WHERE EXISTS (SELECT 1 FROM orc_tasks t WHERE t.queue = r.name AND t.state = 'READY')));
    IF bench THEN
        t0 := clock_timestamp();
    END IF;
    mine := orc_admission_lock_v1(wanted, p_wait);
    IF bench THEN
        t1 := clock_timestamp();
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
        -- a group with no READY work, or one whose queue another admission holds (no wait)
        CONTINUE WHEN NOT (qs <@ mine);
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
    IF bench THEN
        INSERT INTO orc_bench_locks (section, waited_us, held_us)
        VALUES ('admit', extract(epoch FROM t1 - t0) * 1e6, extract(epoch FROM clock_timestamp() - t1) * 1e6);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION orc_admission_lock_v1(p_queues text[], p_wait boolean)
 RETURNS text[]
 LANGUAGE plpgsql
AS $$
DECLARE
    k int;
    held int[] := '{}';
    done text;
BEGIN
    FOREACH k IN ARRAY ARRAY(SELECT DISTINCT hashtext(x.name) FROM unnest(p_queues) AS x(name) ORDER BY 1) LOOP
        IF p_wait THEN
            done := pg_advisory_xact_lock(1869767425, k)::text;  -- an expression, not a statement
            held := held || k;
        ELSIF pg_try_advisory_xact_lock(1869767425, k) THEN
            held := held || k;
        END IF;
    END LOOP;
    RETURN ARRAY(SELECT x.name FROM unnest(p_queues) AS x(name) WHERE hashtext(x.name) = ANY (held));
END
$$;
"""
