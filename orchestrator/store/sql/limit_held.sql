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
