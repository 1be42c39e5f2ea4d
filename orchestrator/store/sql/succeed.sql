-- orc_succeed_v1: RUNNING -> SUCCEEDED for p_attempt with the result, settled and admitted.
--
-- One statement, so one round trip in autocommit: the compare-and-set and its ledger row, the
-- settlement (orc_settle_v1), then either the worker's slot passed on (orc_pass_slot_v1, when
-- nothing became READY and the worker is live) or the whole admission (orc_admit_v1). Returns
-- {"accepted": true, "dispatches": [...]} or {"accepted": false, "conflict"}.

CREATE OR REPLACE FUNCTION orc_succeed_v1(p_run text, p_key text, p_attempt integer, p_result json,
    p_window integer, p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    kids json;
    who text;
    conflict text;
    dispatches json;
    group_queues text;
BEGIN
    UPDATE orc_tasks t SET state = 'SUCCEEDED', result = p_result, finished_at = now(), lease_expires_at = NULL
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'RUNNING' AND t.attempt = p_attempt
    RETURNING t.children, t.worker INTO kids, who;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'SUCCEEDED', 'worker', NULL);
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'SUCCEEDED', 'worker', NULL, NULL, true, now());
    IF orc_settle_v1(p_run, p_key, 'SUCCEEDED', kids, 'worker', NULL) = 0 THEN
        -- the claim recorded the worker as "<worker name>:<pid>"
        SELECT w.queues::text INTO group_queues FROM orc_workers w
        WHERE w.name = regexp_replace(who, ':[0-9]+$', '') AND w.seen_at > now() - make_interval(secs => p_worker_ttl);
        IF FOUND THEN
            SELECT coalesce(json_agg(d), '[]'::json) INTO dispatches
            FROM orc_pass_slot_v1(group_queues, p_worker_ttl, p_depth, p_aging) d;
            RETURN json_build_object('accepted', true, 'dispatches', dispatches);
        END IF;
    END IF;
    SELECT coalesce(json_agg(d ORDER BY d.priority_rank, d.ready_at), '[]'::json) INTO dispatches
    FROM orc_admit_v1(p_window, p_worker_ttl, p_depth, true, p_aging) d;
    RETURN json_build_object('accepted', true, 'dispatches', dispatches);
END
$$;
