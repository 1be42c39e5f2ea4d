-- The names earlier releases call, for their workers still running during a rolling upgrade:
-- each is a shim over the function that now does the work. The _v1 functions that 0011 replaced
-- (orc_claim_v1, orc_succeed_v1, orc_settle_v1; orc_decide_v1 is dropped: only settlement
-- called it) keep their signatures; so do the _v1 functions of clear.sql that 0014 replaced
-- (orc_clear_v1, orc_mark_v1 for the previous release's operator commands and web page, and
-- orc_redecide_v1 that they called); the admission's _v1 functions that 0017 replaced
-- (orc_admit_v1, orc_admit_from_v1, orc_pass_slot_v1: their rows without the direct flag); the
-- orc_wake_due_v1 that 0035 replaced (orc_wake_due_v2 without a shard filter); the
-- orc_settle_v3 that 0038 replaced (orc_settle_v4 with the task's stripe read first); the
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

CREATE OR REPLACE FUNCTION orc_wake_due_v1(p_limit integer, p_actor text)
 RETURNS json
 LANGUAGE sql
AS $$
SELECT orc_wake_due_v2(p_limit, p_actor, NULL, NULL)
$$;

CREATE OR REPLACE FUNCTION orc_settle_v3(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text, p_setup boolean, p_map_parent text, OUT readied integer, OUT closed integer)
 LANGUAGE sql
AS $$
SELECT s.readied, s.closed
FROM orc_settle_v4(p_run, p_key, p_state, p_children, p_actor, p_by, p_setup, p_map_parent,
                   (SELECT t.stripe FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key)) AS s
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
