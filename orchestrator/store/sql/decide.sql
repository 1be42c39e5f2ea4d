-- orc_decide_v1: a trigger rule's verdict from a task's upstream counters.
--
-- READY, SKIPPED or UPSTREAM_FAILED once the rule is decided by the counters (total upstream,
-- done, succeeded, failed, skipped), NULL while it is not. Called by orc_settle_v1 for each
-- child whose counters a finished parent changed; the only implementation of the trigger rules.

CREATE OR REPLACE FUNCTION orc_decide_v1(rule text, total integer, done integer, ok integer, failed integer,
    skipped integer)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $$
SELECT CASE rule
    WHEN 'all_success' THEN CASE WHEN failed > 0 THEN 'UPSTREAM_FAILED' WHEN skipped > 0 THEN 'SKIPPED'
                                 WHEN done >= total THEN 'READY' END
    WHEN 'all_done' THEN CASE WHEN done >= total THEN 'READY' END
    WHEN 'one_success' THEN CASE WHEN ok > 0 THEN 'READY'
                                 WHEN done >= total THEN
                                     CASE WHEN failed > 0 THEN 'UPSTREAM_FAILED' ELSE 'SKIPPED' END END
    WHEN 'one_failed' THEN CASE WHEN failed > 0 THEN 'READY' WHEN done >= total THEN 'SKIPPED' END
    WHEN 'none_failed' THEN CASE WHEN failed > 0 THEN 'UPSTREAM_FAILED' WHEN done >= total THEN 'READY' END
    WHEN 'all_failed' THEN CASE WHEN ok > 0 OR skipped > 0 THEN 'SKIPPED' WHEN done >= total THEN 'READY' END
END
$$;
