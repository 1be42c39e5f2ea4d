"""Concurrency limits and rate limits at admission: named pools (``orc_pools``; a task's
``pool``, ``pool_slots``), deployment-wide token buckets (``orc_rate_limits``; a task's
``rate_limit``), a run's ``max_active_tasks`` and per-DAG limits (``orc_dag_limits``).
``orc_admit_from`` checks them, and the tenant limit, under the admission lock.

Revision ID: 0006
Revises: 0005
"""

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def _in_flight(where: str, what: str = "1", join: str = "") -> str:
    """Rows of tasks in flight (QUEUED or RUNNING) matching ``where``, read by two scans of the
    state index in index order (in flight is bounded by the workers' window, however large the
    backlog; see 0005's IN_FLIGHT for why index order)."""
    return (
        f"FROM unnest(ARRAY['QUEUED', 'RUNNING']) AS s(state) CROSS JOIN LATERAL"
        f" (SELECT {what} FROM orc_tasks t {join} WHERE t.state = s.state AND {where}"
        f" ORDER BY t.state, t.priority_rank, t.ready_at LIMIT 1000000000) AS i"
    )


SQL = r"""
-- Migration 0006: limits at admission.
--
-- Every limit is counted from the task rows (QUEUED + RUNNING), so a slot frees exactly when
-- its task ends, its lease expires (the reconciler makes it READY or FAILED) or its run is
-- cancelled: nothing is held anywhere else, nothing can leak.
--
-- A pick that some limit applies to is checked under the admission lock (pg_advisory_xact_lock
-- 1869767425, which orc_admit holds already and orc_pass_slot takes then), with counts read by
-- that statement: concurrent hand-offs cannot both take a pool's last slot. Picks no limit
-- applies to take no lock (one lookup of the run's row and of its DAG's limit).

-- what holds back a READY task that admission picked, or NULL: 'tenant' (the tenant's
-- max_running), 'run' (the run's max_active_tasks or its DAG's limit), 'pool' (the pool is full
-- or gone), 'slots' (the pool has free slots, fewer than this task asks), 'rate' (no token, or
-- the rate limit is gone)
CREATE OR REPLACE FUNCTION orc_limit_held(p_run text, p_tenant text, p_tenant_limit int, p_pool text,
                                          p_pool_slots int, p_rate text)
RETURNS text LANGUAGE plpgsql AS $$
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
        SELECT count(*) INTO n {tenant_in_flight};
        IF n >= p_tenant_limit THEN
            RETURN 'tenant';
        END IF;
    END IF;
    IF run_limit IS NOT NULL THEN
        SELECT count(*) INTO n {run_in_flight};
        IF n >= run_limit THEN
            RETURN 'run';
        END IF;
    END IF;
    IF dag_limit IS NOT NULL THEN
        SELECT count(*) INTO n {dag_in_flight};
        IF n >= dag_limit THEN
            RETURN 'run';
        END IF;
    END IF;
    IF p_pool IS NOT NULL THEN
        SELECT p.slots INTO free FROM orc_pools p WHERE p.name = p_pool;
        IF NOT FOUND THEN
            RETURN 'pool';
        END IF;
        SELECT free - coalesce(sum(i.pool_slots), 0) INTO free {pool_in_flight};
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

-- 0005's orc_admit_from, with the limits: a pick that a limit holds back is set aside (its run,
-- tenant, pool or rate limit for the rest of this call; a task too large for its pool's free
-- slots alone) and the next best head is looked at. Admission takes a rate limit's token when
-- it moves the task.
CREATE OR REPLACE FUNCTION orc_admit_from(p_queues text[], p_room int, p_aging float8)
RETURNS TABLE (run_id text, key text, attempt int, task_name text, args json, kwargs json, queue text,
               soft_time_limit float8, time_limit float8, priority_rank int, ready_at timestamptz)
LANGUAGE plpgsql AS $$
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
    n int;
BEGIN
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
        why := orc_limit_held(pick.run_id, pick.tenant, pick.tenant_limit, pick.pool, pick.pool_slots,
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

ALTER FUNCTION orc_limit_held(text, text, int, text, int, text) SET plan_cache_mode = force_generic_plan;
ALTER FUNCTION orc_admit_from(text[], int, float8) SET plan_cache_mode = force_generic_plan;
"""
for _name, _sql in {
    "{tenant_in_flight}": _in_flight("t.tenant = p_tenant"),
    "{run_in_flight}": _in_flight("t.run_id = p_run"),
    "{dag_in_flight}": _in_flight(
        "r.tenant = p_tenant AND r.dag_name = dag", join="JOIN orc_runs r ON r.id = t.run_id"
    ),
    "{pool_in_flight}": _in_flight("t.pool = p_pool", what="t.pool_slots"),
}.items():
    SQL = SQL.replace(_name, _sql)


def upgrade() -> None:
    op.add_column("orc_runs", sa.Column("max_active_tasks", sa.Integer, nullable=True))
    op.add_column("orc_tasks", sa.Column("pool", sa.String(64), nullable=True))
    op.add_column("orc_tasks", sa.Column("pool_slots", sa.Integer, nullable=False, server_default="1"))
    op.add_column("orc_tasks", sa.Column("rate_limit", sa.String(64), nullable=True))
    op.create_table(
        "orc_pools",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("slots", sa.Integer, nullable=False),
        sa.Column("description", sa.Text, nullable=True),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_table(
        "orc_rate_limits",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("rate", sa.Float, nullable=False),
        sa.Column("burst", sa.Integer, nullable=False),
        sa.Column("tokens", sa.Float, nullable=False),
        sa.Column("refilled_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_table(
        "orc_dag_limits",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("dag_name", sa.String(200), primary_key=True),
        sa.Column("max_running", sa.Integer, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(SQL)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS orc_limit_held(text, text, int, text, int, text)")
        # 0005's orc_admit_from (CREATE OR REPLACE; its other statements are idempotent)
        previous = importlib.import_module("orchestrator.store.migrations.versions.0005_pass_slot")
        op.execute(previous.SQL)
    op.drop_table("orc_dag_limits")
    op.drop_table("orc_rate_limits")
    op.drop_table("orc_pools")
    with op.batch_alter_table("orc_tasks") as batch:
        batch.drop_column("rate_limit")
        batch.drop_column("pool_slots")
        batch.drop_column("pool")
    with op.batch_alter_table("orc_runs") as batch:
        batch.drop_column("max_active_tasks")
