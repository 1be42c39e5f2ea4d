-- orc_admit_v2: READY -> QUEUED within the live workers' capacity, in fair order.
--
-- For each group of live workers consuming the same queues that has READY work, the room is
-- their concurrency x p_depth less the tasks in flight on those queues, and at most p_window
-- tasks are in flight in all; orc_admit_from_v2 fills the room. Serialized per queue: the
-- admission locks of the groups' queues (orc_admission_lock_v1), so admissions of groups that
-- share no queue never wait for each other. p_wait = true waits for them (a completion, a
-- submit), false admits only the groups whose locks are free (the reconciler). The window is
-- counted, after the locks, from what other admissions committed: groups admitted at the same
-- moment may together pass it by what they admitted meanwhile (at most their rooms); each
-- group's own room is exact. Returns the rows to publish after the caller commits. With
-- orc.bench_locks = on (bench/locks.py) it adds a row to orc_bench_locks: how long the locks
-- took and how long they were held up to its end.

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

-- orc_admission_lock_v1: the admission locks of p_queues, one advisory transaction lock per
-- queue (key 1869767425, hashtext(queue)), taken in key order so that admissions waiting for
-- each other's queues never wait in a cycle; every other lock admission takes (the cross-group
-- lock of limits and breakers, 1869767425, rows) comes after them. p_wait = false takes only
-- those free now. Returns the queues whose locks this transaction holds. Each lock is taken in
-- an expression (no statement of the executor's per queue).

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
