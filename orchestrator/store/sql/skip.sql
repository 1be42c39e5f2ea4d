-- orc_skip_v1: a task body raised orchestrator.Skip: RUNNING -> SKIPPED for p_attempt.
--
-- The compare-and-set (fenced by the attempt like a success) with its ledger row ("user: " and
-- the reason), the settlement (orc_settle_v2: the children follow their trigger rules), then
-- what to publish (orc_dispatch_v1). Returns {"accepted": true, "dispatches": [...]} or
-- {"accepted": false, "conflict"}.

CREATE OR REPLACE FUNCTION orc_skip_v1(p_run text, p_key text, p_attempt integer, p_reason text, p_window integer,
    p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    kids json;
    who text;
    conflict text;
    readied int;
BEGIN
    UPDATE orc_tasks t SET state = 'SKIPPED', finished_at = now(), lease_expires_at = NULL, skip_reason = 'user'
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'RUNNING' AND t.attempt = p_attempt
    RETURNING t.children, t.worker INTO kids, who;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'SKIPPED', 'worker', 'skip: ' || left(p_reason, 500));
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'SKIPPED', 'worker', NULL, 'user: ' || left(p_reason, 1000), true,
            now());
    readied := orc_settle_v2(p_run, p_key, 'SKIPPED', kids, 'worker', NULL);
    RETURN json_build_object('accepted', true,
                             'dispatches', orc_dispatch_v1(readied, who, p_window, p_worker_ttl, p_depth, p_aging));
END
$$;
