"""Circuit breakers per resource: a task's ``resources`` (``orc_tasks.resources``), a breaker per
resource (``orc_breakers``: mode, state, trip rule, open period, probes, ramp), its calls per
second (``orc_breaker_counts``), its half-open probes' leases (``orc_breaker_probes``) and its
ledger (``orc_breaker_events``).

The functions of ``breaker.sql``; ``orc_limit_held_v2`` says 'breaker' for a task whose
resource's breaker holds it (``orc_limit_held_v1`` becomes a shim over it, ``legacy.sql``);
``orc_admit_from_v2``, ``orc_succeed_v2`` and ``orc_map_insert_v1`` changed in place: admission
holds the tasks of an open resource and hands out probe permits and ramp places, a success
counts as a call of the task's resources, a map's children take their node's resources. Their
meaning for every task an earlier release makes (no resources) is unchanged.

Revision ID: 0018
Revises: 0017
"""

import importlib

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)

NEW_SIGNATURES = (
    "orc_limit_held_v2(text, text, integer, text, integer, text, text[])",
    "orc_breaker_v1(text[], text, text, integer, boolean, text[], text)",
    "orc_breaker_move_v1(text, text, text, text, text)",
    "orc_breaker_reopen_v1(text, text, text)",
    "orc_breaker_held_v1(text[])",
    "orc_breaker_admitted_v1(text, text, text[])",
    "orc_breaker_tick_v1()",
)


def upgrade() -> None:
    op.add_column("orc_tasks", sa.Column("resources", postgresql.ARRAY(sa.Text), nullable=True))
    op.create_table(
        "orc_breakers",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("forced", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("window_seconds", sa.Float, nullable=False),
        sa.Column("min_calls", sa.Integer, nullable=False),
        sa.Column("min_failures", sa.Integer, nullable=False),
        sa.Column("failure_rate", sa.Float, nullable=False),
        sa.Column("failure_on", postgresql.ARRAY(sa.Text), nullable=True),
        sa.Column("open_min", sa.Float, nullable=False),
        sa.Column("open_max", sa.Float, nullable=False),
        sa.Column("probes", sa.Integer, nullable=False),
        sa.Column("probe_lease", sa.Float, nullable=False),
        sa.Column("ramp_max", sa.Integer, nullable=False),
        sa.Column("open_for", sa.Float, nullable=True),
        sa.Column("open_until", TS, nullable=True),
        sa.Column("reopens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("probes_left", sa.Integer, nullable=False, server_default="0"),
        sa.Column("wave", sa.Integer, nullable=True),
        sa.Column("wave_admitted", sa.Integer, nullable=False, server_default="0"),
        sa.Column("wave_done", sa.Integer, nullable=False, server_default="0"),
        sa.Column("wave_at", TS, nullable=True),
        sa.Column("changed_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_table(
        "orc_breaker_counts",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("second", TS, primary_key=True),
        sa.Column("calls", sa.Integer, nullable=False),
        sa.Column("failures", sa.Integer, nullable=False),
    )
    op.create_table(
        "orc_breaker_probes",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("run_id", sa.String(32), primary_key=True),
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True),
        sa.Column("lease_until", TS, nullable=False),
    )
    op.create_table(
        "orc_breaker_events",
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
    op.create_index("ix_orc_breaker_events_name", "orc_breaker_events", ["name", "id"])
    op.create_index(
        "ix_orc_breaker_events_unalerted", "orc_breaker_events", ["id"], postgresql_where=sa.text("alerted_at IS NULL")
    )
    op.execute(SQL)


def downgrade() -> None:
    # orc_limit_held_v1 as 0016 installed it and orc_map_insert_v1 as 0011 did, then 0017's
    # admission, success and shims, then this revision's functions and tables go
    op.execute(OLD_SQL)
    op.execute(importlib.import_module("orchestrator.store.migrations.versions.0017_direct_messages").SQL)
    for signature in NEW_SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.drop_index("ix_orc_breaker_events_unalerted", table_name="orc_breaker_events")
    op.drop_index("ix_orc_breaker_events_name", table_name="orc_breaker_events")
    op.drop_table("orc_breaker_events")
    op.drop_table("orc_breaker_probes")
    op.drop_table("orc_breaker_counts")
    op.drop_table("orc_breakers")
    op.drop_column("orc_tasks", "resources")


#: store/sql/breaker.sql, limit_held.sql, admit_from.sql, expand.sql, succeed.sql and legacy.sql as this
#: revision installs them (frozen: a later change is a later migration)
SQL = r"""
-- orc_breaker_v1: a finished attempt of a task that uses p_resources, counted by their breakers.
--
-- Called in the transaction of the attempt's outcome, after its admission (orc_succeed_v2 for a
-- success, the failure path for a failure with the exception's class names p_exc_types). A
-- success is a call; a failure is counted only when it is the resource's: a time-out, a
-- connection error, or a class the breaker names in failure_on (any other failure tells nothing
-- about the resource). Calls go to per-second buckets (orc_breaker_counts); a counted failure
-- checks the trip rule over the last window_seconds (calls >= min_calls, failures >=
-- min_failures, failures / calls >= failure_rate) and opens the breaker. The outcome of a probe
-- (orc_breaker_probes) closes a half-open breaker (the ramp's first wave next) or opens it again
-- for twice as long (up to open_max). A success in the ramp's wave counts toward the next wave.
-- Every change of a breaker's row is made under the admission lock, taken before the buckets
-- (a plain success in a closed breaker takes no lock but its bucket's row). A breaker in
-- mode 'metrics' counts and never changes state; 'disabled' counts nothing.

CREATE OR REPLACE FUNCTION orc_breaker_v1(p_resources text[], p_run text, p_key text, p_attempt integer,
    p_failed boolean, p_exc_types text[], p_actor text)
 RETURNS void
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    b record;
    counted boolean;
    probe boolean;
    calls bigint;
    fails bigint;
    locked boolean := false;
BEGIN
    -- the admission lock before any bucket's row, for every breaker at once (a lock taken between
    -- two buckets could wait for a transaction that waits for the first bucket)
    IF EXISTS (SELECT 1 FROM orc_breakers k WHERE k.name = ANY (p_resources) AND k.mode = 'on'
               AND (p_failed OR k.state <> 'closed' OR k.wave IS NOT NULL)) THEN
        PERFORM pg_advisory_xact_lock(1869767425);
        locked := true;
    END IF;
    FOR b IN SELECT * FROM orc_breakers k WHERE k.name = ANY (p_resources) AND k.mode <> 'disabled' ORDER BY k.name
    LOOP
        counted := NOT p_failed OR coalesce(p_exc_types && ARRAY['TimeoutError', 'SoftTimeLimitExceeded',
            'TimeLimitExceeded', 'ConnectionError', 'OSError', 'socket.timeout', 'WaitTimeout']
            OR p_exc_types && b.failure_on, false);
        IF NOT locked AND b.mode = 'on' AND (b.state <> 'closed' OR b.wave IS NOT NULL) THEN
            -- it changed state since the look above (rare): lock now, and read it again
            PERFORM pg_advisory_xact_lock(1869767425);
            locked := true;
            SELECT * INTO b FROM orc_breakers k WHERE k.name = b.name;
        END IF;
        IF counted THEN
            INSERT INTO orc_breaker_counts AS c (name, second, calls, failures)
            VALUES (b.name, date_trunc('second', now()), 1, CASE WHEN p_failed THEN 1 ELSE 0 END)
            ON CONFLICT (name, second) DO UPDATE SET calls = c.calls + 1, failures = c.failures + excluded.failures;
        END IF;
        CONTINUE WHEN b.mode <> 'on';
        DELETE FROM orc_breaker_probes p
        WHERE p.name = b.name AND p.run_id = p_run AND p.key = p_key AND p.attempt = p_attempt;
        probe := FOUND;
        IF probe AND b.state = 'half_open' THEN
            IF NOT counted THEN
                -- a failure that is not the resource's: the permit goes to another probe
                UPDATE orc_breakers k SET probes_left = k.probes_left + 1, updated_at = now() WHERE k.name = b.name;
            ELSIF p_failed THEN
                PERFORM orc_breaker_reopen_v1(b.name, p_actor,
                    'probe ' || p_run || '/' || p_key || ' #' || p_attempt || ' failed: '
                    || coalesce(p_exc_types[1], 'error'));
            ELSE
                PERFORM orc_breaker_move_v1(b.name, 'closed', p_actor, NULL,
                    'probe ' || p_run || '/' || p_key || ' #' || p_attempt || ' succeeded');
                UPDATE orc_breakers k SET wave = CASE WHEN k.ramp_max > 1 THEN 1 END, wave_admitted = 0,
                    wave_done = 0, wave_at = now(), reopens = 0, open_for = NULL
                WHERE k.name = b.name;
            END IF;
        ELSIF b.state = 'closed' AND counted THEN
            IF p_failed THEN
                SELECT coalesce(sum(c.calls), 0), coalesce(sum(c.failures), 0) INTO calls, fails
                FROM orc_breaker_counts c
                WHERE c.name = b.name AND c.second > now() - make_interval(secs => b.window_seconds);
                IF calls >= b.min_calls AND fails >= b.min_failures AND fails >= b.failure_rate * calls THEN
                    UPDATE orc_breakers k SET open_for = k.open_min, reopens = 0 WHERE k.name = b.name;
                    PERFORM orc_breaker_move_v1(b.name, 'open', p_actor, NULL,
                        fails || ' of ' || calls || ' calls failed in ' || b.window_seconds || 's (last: '
                        || coalesce(p_exc_types[1], 'error') || ')');
                ELSIF b.wave IS NOT NULL THEN
                    -- a failure in the ramp: it starts again from one task
                    UPDATE orc_breakers k SET wave = 1, wave_admitted = 0, wave_done = 0, wave_at = now(),
                        updated_at = now()
                    WHERE k.name = b.name;
                END IF;
            ELSIF b.wave IS NOT NULL THEN
                IF b.wave_done + 1 >= b.wave AND b.wave_admitted >= b.wave THEN
                    -- the wave succeeded: the next one is twice as large, the ramp ends past ramp_max
                    UPDATE orc_breakers k SET wave = CASE WHEN k.wave * 2 <= k.ramp_max THEN k.wave * 2 END,
                        wave_admitted = 0, wave_done = 0, wave_at = now(), updated_at = now()
                    WHERE k.name = b.name;
                ELSE
                    UPDATE orc_breakers k SET wave_done = k.wave_done + 1 WHERE k.name = b.name;
                END IF;
            END IF;
        END IF;
    END LOOP;
END
$$;

-- orc_breaker_move_v1: a breaker's state change and its ledger row (orc_breaker_events): to
-- 'open' (until now() + open_for; forced by an operator: until closed), 'half_open' (probes
-- permits), 'closed'. The caller holds the admission lock.

CREATE OR REPLACE FUNCTION orc_breaker_move_v1(p_name text, p_to text, p_actor text, p_by text, p_reason text)
 RETURNS void
 LANGUAGE plpgsql
AS $$
DECLARE
    was text;
BEGIN
    SELECT k.state INTO was FROM orc_breakers k WHERE k.name = p_name;
    UPDATE orc_breakers k
    SET state = p_to,
        open_until = CASE WHEN p_to = 'open' AND NOT k.forced THEN now() + make_interval(secs => k.open_for) END,
        probes_left = CASE WHEN p_to = 'half_open' THEN k.probes ELSE 0 END,
        wave = CASE WHEN p_to = 'closed' THEN k.wave END,
        forced = p_to = 'open' AND k.forced,
        changed_at = now(), updated_at = now()
    WHERE k.name = p_name;
    IF p_to <> 'half_open' THEN
        DELETE FROM orc_breaker_probes p WHERE p.name = p_name;
    END IF;
    INSERT INTO orc_breaker_events (name, from_state, to_state, actor, by, reason, at)
    VALUES (p_name, was, p_to, p_actor, p_by, p_reason, now());
END
$$;

-- orc_breaker_reopen_v1: a half-open breaker's probe failed (or outlived its lease): open again
-- for twice the last open_for, at most open_max. The caller holds the admission lock.

CREATE OR REPLACE FUNCTION orc_breaker_reopen_v1(p_name text, p_actor text, p_reason text)
 RETURNS void
 LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE orc_breakers k
    SET reopens = k.reopens + 1, open_for = least(k.open_max, coalesce(k.open_for, k.open_min / 2) * 2)
    WHERE k.name = p_name;
    PERFORM orc_breaker_move_v1(p_name, 'open', p_actor, NULL, p_reason);
END
$$;

-- orc_breaker_held_v1: which of p_resources' breakers holds a task back now, or NULL.
--
-- Open (until open_until, or forced), half-open with no probe permit left, or ramping with its
-- wave full. An open breaker whose open_until passed becomes half-open here (its ledger row
-- says the dispatcher moved it). The caller holds the admission lock.

CREATE OR REPLACE FUNCTION orc_breaker_held_v1(p_resources text[])
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    b record;
BEGIN
    FOR b IN SELECT * FROM orc_breakers k
             WHERE k.name = ANY (p_resources) AND k.mode = 'on' AND (k.state <> 'closed' OR k.wave IS NOT NULL)
             ORDER BY k.name
    LOOP
        IF b.state = 'open' THEN
            IF b.forced OR b.open_until > now() THEN
                RETURN b.name;
            END IF;
            PERFORM orc_breaker_move_v1(b.name, 'half_open', 'dispatcher', NULL,
                'open for ' || b.open_for || 's: ' || b.probes || ' probe(s)');
            CONTINUE WHEN b.probes > 0;
            RETURN b.name;
        ELSIF b.state = 'half_open' THEN
            CONTINUE WHEN b.probes_left > 0;
            RETURN b.name;
        ELSIF b.wave_admitted >= b.wave THEN
            RETURN b.name;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- orc_breaker_admitted_v1: admission moved a task that uses p_resources to QUEUED: a half-open
-- breaker's probe permit becomes a lease on this attempt (probe_lease seconds), a ramping one's
-- wave counts it. The caller holds the admission lock.

CREATE OR REPLACE FUNCTION orc_breaker_admitted_v1(p_run text, p_key text, p_resources text[])
 RETURNS void
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    att int;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM orc_breakers k WHERE k.name = ANY (p_resources) AND k.mode = 'on'
                   AND (k.state = 'half_open' OR k.wave IS NOT NULL)) THEN
        RETURN;
    END IF;
    SELECT t.attempt INTO att FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    INSERT INTO orc_breaker_probes (name, run_id, key, attempt, lease_until)
    SELECT k.name, p_run, p_key, att, now() + make_interval(secs => k.probe_lease)
    FROM orc_breakers k WHERE k.name = ANY (p_resources) AND k.mode = 'on' AND k.state = 'half_open'
    ON CONFLICT DO NOTHING;
    UPDATE orc_breakers k
    SET probes_left = CASE WHEN k.state = 'half_open' THEN k.probes_left - 1 ELSE k.probes_left END,
        wave_admitted = CASE WHEN k.state = 'closed' AND k.wave IS NOT NULL THEN k.wave_admitted + 1
                             ELSE k.wave_admitted END,
        updated_at = now()
    WHERE k.name = ANY (p_resources) AND k.mode = 'on' AND (k.state = 'half_open' OR k.wave IS NOT NULL);
END
$$;

-- orc_breaker_tick_v1: the reconciler's pass over the breakers. A probe that outlived its lease
-- counts as a failure (the breaker opens again: no breaker stays half-open for a probe that never
-- returns); an open breaker whose time is up becomes half-open; a ramp's full wave that did not
-- come back within probe_lease is handed out again (a lost task does not stop the ramp); buckets
-- older than their window are deleted. Returns how many breakers changed state.

CREATE OR REPLACE FUNCTION orc_breaker_tick_v1()
 RETURNS integer
 LANGUAGE plpgsql
AS $$
DECLARE
    p record;
    b record;
    n int := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(1869767425);
    FOR p IN DELETE FROM orc_breaker_probes x WHERE x.lease_until < now() RETURNING x.* LOOP
        IF EXISTS (SELECT 1 FROM orc_breakers k WHERE k.name = p.name AND k.state = 'half_open' AND k.mode = 'on') THEN
            PERFORM orc_breaker_reopen_v1(p.name, 'reconciler',
                'probe ' || p.run_id || '/' || p.key || ' #' || p.attempt || ' outlived its lease');
            n := n + 1;
        END IF;
    END LOOP;
    FOR b IN SELECT k.name, k.open_for, k.probes FROM orc_breakers k
             WHERE k.mode = 'on' AND k.state = 'open' AND NOT k.forced AND k.open_until <= now() LOOP
        PERFORM orc_breaker_move_v1(b.name, 'half_open', 'reconciler', NULL,
            'open for ' || b.open_for || 's: ' || b.probes || ' probe(s)');
        n := n + 1;
    END LOOP;
    UPDATE orc_breakers k SET wave_admitted = 0, wave_done = 0, wave_at = now()
    WHERE k.wave IS NOT NULL AND k.wave_admitted >= k.wave AND k.wave_at < now() - make_interval(secs => k.probe_lease);
    DELETE FROM orc_breaker_counts c USING orc_breakers k
    WHERE c.name = k.name AND c.second < now() - make_interval(secs => k.window_seconds + 1);
    DELETE FROM orc_breaker_counts c WHERE NOT EXISTS (SELECT 1 FROM orc_breakers k WHERE k.name = c.name);
    RETURN n;
END
$$;

-- orc_limit_held_v2: what holds back a READY task that admission picked, or NULL.
--
-- 'breaker' (a breaker of one of the task's p_resources is open, half-open without a probe
-- permit, or ramping with its wave full: orc_breaker_held_v1), 'tenant' (the tenant's
-- max_running), 'run' (the run's max_active_tasks or its DAG's limit), 'pool' (the pool is full
-- or gone), 'slots' (the pool has free slots, fewer than the task asks), 'rate' (no token, or
-- the rate limit is gone). A task without resources costs one null check more than _v1. Every
-- count is of the task rows in flight (QUEUED + RUNNING), so a slot frees exactly when its task
-- ends: nothing can leak. A pick that some limit applies to is checked under the admission lock.

CREATE OR REPLACE FUNCTION orc_limit_held_v2(p_run text, p_tenant text, p_tenant_limit integer, p_pool text,
    p_pool_slots integer, p_rate text, p_resources text[])
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
    IF p_tenant_limit IS NULL AND p_pool IS NULL AND p_rate IS NULL AND run_limit IS NULL AND dag_limit IS NULL
       AND p_resources IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM pg_advisory_xact_lock(1869767425);
    IF p_resources IS NOT NULL AND orc_breaker_held_v1(p_resources) IS NOT NULL THEN
        RETURN 'breaker';
    END IF;
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

-- orc_admit_from_v2: up to p_room READY tasks of p_queues -> QUEUED, one pick at a time.
--
-- Each pick is the best head: of each tenant's READY tasks in each queue the first (priority,
-- then age); among the heads the highest class (a task READY for p_aging seconds counts one
-- class higher, twice as long two), then the tenant furthest below its weighted share of the
-- tasks in flight on these queues, then round robin (last_admitted_at), then the oldest. A pick
-- that a limit holds back (orc_limit_held_v2) is set aside with its tenant, run, pool, rate
-- limit or breaker (its resource) and the next head is looked at: a held pick uses no room, and a pass looks at most
-- p_room + 1000 times (a backlog too big for its pool's free slots is passed over 1,000 at a
-- time per pass, not all of it). Each row says whether its message is direct: the message's
-- arguments are all the body gets (no upstream results, map item, sensor or resumed state), so a
-- worker may start the body before claiming (orc_claim_succeed_v1). A task admitted with
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
        SELECT h.run_id, h.key, h.tenant, h.pool, h.pool_slots, h.rate_limit, h.resources,
               w.max_running AS tenant_limit,
               min(h.tenant) OVER () <> max(h.tenant) OVER () AS contested INTO pick
        FROM tq
        CROSS JOIN LATERAL (
            SELECT p.run_id, p.key, p.tenant, p.priority_rank, p.ready_at, p.pool, p.pool_slots, p.rate_limit,
                   p.resources
            FROM orc_tasks p
            WHERE p.queue = tq.queue AND p.state = 'READY' AND p.tenant = tq.tenant
              AND NOT ((p.run_id || '/' || p.key) = ANY (skipped))
              AND NOT (p.run_id = ANY (held_runs))
              AND (p.pool IS NULL OR NOT (p.pool = ANY (held_pools)))
              AND (p.rate_limit IS NULL OR NOT (p.rate_limit = ANY (held_rates)))
              AND (p.resources IS NULL OR NOT (p.resources && held_breakers))
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
-- with the same slice. Each child uses its node's resources (their circuit breakers). Returns
-- how many children it made READY.

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
        map_failed, map_skipped, resources)
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
           CASE WHEN p_item_of IS NULL THEN NULL ELSE p_item_of || '[' || (x->>'k') || ']' END, 0, 0, 0, 0, 0,
           h.resources
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

-- orc_succeed_v2: RUNNING -> SUCCEEDED for p_attempt with the result, settled and admitted.
--
-- One statement, so one round trip in autocommit: the result checked (orc_result_problem_v1),
-- the compare-and-set and its ledger row, a branch's or short circuit's skips
-- (orc_follow_v1), the settlement (orc_settle_v2), then what to publish (orc_dispatch_v1), then,
-- for a task that uses resources, the call counted by their breakers (orc_breaker_v1; a task
-- without resources, as every task an earlier release wrote, costs one null check).
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
    res text[];
    dispatches json;
    readied int := 0;
BEGIN
    SELECT t.flow, t.feeds_map, t.resources INTO flow, feeds, res
    FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
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
    dispatches := orc_dispatch_v1(readied, who, p_window, p_worker_ttl, p_depth, p_aging);
    IF res IS NOT NULL THEN
        PERFORM orc_breaker_v1(res, p_run, p_key, p_attempt, false, NULL, 'worker');
    END IF;
    RETURN json_build_object('accepted', true, 'dispatches', dispatches);
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

CREATE OR REPLACE FUNCTION orc_limit_held_v1(p_run text, p_tenant text, p_tenant_limit integer, p_pool text,
    p_pool_slots integer, p_rate text)
 RETURNS text
 LANGUAGE sql
AS $$
SELECT orc_limit_held_v2(p_run, p_tenant, p_tenant_limit, p_pool, p_pool_slots, p_rate, NULL)
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

#: orc_limit_held_v1 as 0016 installed it and orc_map_insert_v1 as 0011 did (before this revision)
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

-- orc_map_insert_v1 as 0011 installed it (expand.sql before this revision)

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
"""
