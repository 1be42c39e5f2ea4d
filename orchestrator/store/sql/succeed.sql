-- orc_succeed_v2: RUNNING -> SUCCEEDED for p_attempt with the result, settled and admitted.
--
-- One statement, so one round trip in autocommit: the result checked (orc_result_problem_v1),
-- the compare-and-set and its ledger row, a branch's or short circuit's skips
-- (orc_follow_v1), the settlement (orc_settle_v4) and the run's count of open tasks
-- (orc_close_v1, unless the success is held in a striped fan-in's stripe), then what to
-- publish (orc_dispatch_v1), then, for a task that uses resources,
-- the call counted by their breakers (orc_breaker_v1; a task without resources, as every task an
-- earlier release wrote, costs one null check).
-- A task with no branch or short circuit that feeds no map (every task but those) is settled
-- from its compare-and-set alone: the UPDATE's RETURNING gives what the rest needs, no row is
-- read before it. The others read their node first, for the result's check. The
-- compare-and-set and its ledger row are one statement (a data-modifying WITH).
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
    t record;
    flow text;
    feeds boolean;
    conflict text;
    problem text;
    dispatches json;
    readied int := 0;
    s record;
    open_left int;
BEGIN
    WITH done AS (
        UPDATE orc_tasks x SET state = 'SUCCEEDED', result = p_result, finished_at = now(), lease_expires_at = NULL
        WHERE x.run_id = p_run AND x.key = p_key AND coalesce(x.state, '') = 'RUNNING' AND x.attempt = p_attempt
          AND x.flow IS NULL AND NOT x.feeds_map
        RETURNING x.children, x.worker, x.resources, x.role = 'setup' AS setup, x.map_parent, x.flow,
                      x.stripe
    ), logged AS (
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        SELECT p_run, p_key, p_attempt, 'RUNNING', 'SUCCEEDED', 'worker', NULL, NULL, true, now() FROM done
    )
    SELECT d.* INTO t FROM done d;
    IF NOT FOUND THEN
        -- a branch, a short circuit, a map's source (its result is checked first), or a conflict
        SELECT x.flow, x.feeds_map INTO flow, feeds FROM orc_tasks x WHERE x.run_id = p_run AND x.key = p_key;
        IF flow IS NOT NULL OR feeds THEN
            problem := orc_result_problem_v1(p_run, p_key, p_result);
            IF problem IS NOT NULL THEN
                RETURN json_build_object('accepted', false, 'invalid', problem);
            END IF;
        END IF;
        WITH done AS (
            UPDATE orc_tasks x SET state = 'SUCCEEDED', result = p_result, finished_at = now(), lease_expires_at = NULL
            WHERE x.run_id = p_run AND x.key = p_key AND coalesce(x.state, '') = 'RUNNING' AND x.attempt = p_attempt
            RETURNING x.children, x.worker, x.resources, x.role = 'setup' AS setup, x.map_parent, x.flow,
                      x.stripe
        ), logged AS (
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            SELECT p_run, p_key, p_attempt, 'RUNNING', 'SUCCEEDED', 'worker', NULL, NULL, true, now() FROM done
        )
        SELECT d.* INTO t FROM done d;
        IF NOT FOUND THEN
            conflict := orc_reject_v1(p_run, p_key, p_attempt, 'SUCCEEDED', 'worker', NULL);
            RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
        END IF;
    END IF;
    IF t.flow IS NOT NULL THEN
        readied := orc_follow_v1(p_run, p_key, t.flow, t.children, p_result, 'worker', NULL);
    END IF;
    s := orc_settle_v4(p_run, p_key, 'SUCCEEDED', t.children, 'worker', NULL, t.setup, t.map_parent, t.stripe);
    -- the run's row next, before the admission: every path that settles takes the run's row
    -- before the admission locks (a skip, a wait's end, a clear, a failure), so this one does too;
    -- a success held in its fan-in's stripe closes nothing yet, and the run's row is not written
    IF s.closed <> 0 THEN
        open_left := orc_close_v1(p_run, s.closed, 'worker', NULL);
    END IF;
    readied := readied + s.readied;
    dispatches := orc_dispatch_v1(readied, t.worker, p_window, p_worker_ttl, p_depth, p_aging);
    IF t.resources IS NOT NULL THEN
        PERFORM orc_breaker_v1(t.resources, p_run, p_key, p_attempt, false, NULL, 'worker');
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
-- PENDING task downstream of it (reason short_circuit), whatever their trigger rules; one with
-- ignore_downstream_trigger_rules=False ('circuit_direct', Airflow's option) skips only its
-- direct children, each settled so the tasks below follow their own trigger rules. Called
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
    IF p_flow = 'circuit_direct' AND falsy THEN
        FOR m IN
            UPDATE orc_tasks t SET state = 'SKIPPED', finished_at = now(), skip_reason = 'short_circuit'
            WHERE t.run_id = p_run AND t.key IN (SELECT json_array_elements_text(p_children)) AND t.state = 'PENDING'
            RETURNING t.key, t.attempt, t.children
        LOOP
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            VALUES (p_run, m.key, m.attempt, 'PENDING', 'SKIPPED', p_actor, p_by,
                    'short_circuit: ' || p_key || ' returned ' || left(coalesce(p_result::text, 'null'), 40),
                    true, now());
            readied := readied + orc_settle_v2(p_run, m.key, 'SKIPPED', m.children, p_actor, p_by);
        END LOOP;
        RETURN readied;
    END IF;
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
