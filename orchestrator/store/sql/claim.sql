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
-- transactional task's (orc_tasks.transactional) "transactional": true. The compare-and-set and
-- its ledger row are one statement (a data-modifying WITH).

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
    -- the compare-and-set and its ledger row in one statement
    WITH claimed AS (
        UPDATE orc_tasks t SET state = 'RUNNING', started_at = now(), heartbeat_at = now(),
                               lease_expires_at = now() + make_interval(secs => p_lease), worker = p_worker
        WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'QUEUED' AND t.attempt = p_attempt
          AND t.task_name = p_task
        RETURNING t.args, t.kwargs, t.wants_upstream, t.map_parent, t.map_item_from, t.wait_spec, t.wait_resume,
                  t.transactional
    ), logged AS (
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        SELECT p_run, p_key, p_attempt, 'QUEUED', 'RUNNING', 'worker', NULL, 'claim by ' || p_worker, true, now()
        FROM claimed
    )
    SELECT c.* INTO row FROM claimed c;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'RUNNING', 'worker',
                                  'claim by ' || p_worker || ' for a message of ' || p_task);
        RETURN json_build_object('claimed', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
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
