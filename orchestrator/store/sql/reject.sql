-- orc_reject_v1: the conflict ledger's row for a task compare-and-set that lost.
--
-- Writes a rejected event (accepted = false) naming what the row holds, and returns that text
-- ("row holds RUNNING attempt 2"); returns NULL and writes nothing when there is no such task.

CREATE OR REPLACE FUNCTION orc_reject_v1(p_run text, p_key text, p_attempt integer, p_to text, p_actor text,
    p_reason text)
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    held record;
    holds text;
BEGIN
    SELECT state, attempt INTO held FROM orc_tasks WHERE run_id = p_run AND key = p_key;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    holds := 'row holds ' || held.state || ' attempt ' || held.attempt;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, held.state, p_to, p_actor, NULL,
            CASE WHEN p_reason IS NULL THEN holds ELSE p_reason || '; ' || holds END, false, now());
    RETURN holds;
END
$$;
