-- orc_pass_slot_v2: a completion that made nothing READY hands its worker's slots on, in batches.
--
-- When the worker's group (p_queues, its queues as JSON text) is down to one message per slot
-- in flight (capacity x (p_depth - 1) below its capacity x p_depth; with a depth of 1, one slot
-- free), it is filled again to capacity x p_depth with the best READY tasks of those queues
-- (orc_admit_from_v2): no scan of other queues, and one admission per batch of completions
-- instead of one per completion. A batch takes the admission locks of the group's queues
-- (orc_admission_lock_v1) and counts again (what another batch of the group admitted meanwhile
-- is no longer room): admissions of groups that share no queue with it never wait for it. With
-- orc.bench_locks = on (bench/locks.py) a batch adds a row to orc_bench_locks.

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
