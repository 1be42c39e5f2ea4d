-- orc_decide_v2: a trigger rule's verdict from a task's upstream counters (Airflow's 13 rules).
--
-- READY, SKIPPED or UPSTREAM_FAILED once the rule is decided, NULL while it is not. The counters
-- are those of the task's relevant upstream (a mapped parent counts once per child): total,
-- done, succeeded, failed (FAILED), upstream_failed, skipped, and of them the setup tasks (total
-- setups, succeeded, skipped). A verdict reached while done < total is an early verdict.
-- p_ratio (0 < r <= 1, all_success only): READY once done = total and at least
-- ceil(r x total) succeeded; decided early once that many can no longer succeed.
-- Called by orc_settle_v2 for each child whose counters a finished parent changed; the only
-- implementation of the trigger rules (``always`` is READY at submit and never asks).
-- The Python statement of the same table is tests/store/test_trigger_rules.py's.

CREATE OR REPLACE FUNCTION orc_decide_v2(rule text, total integer, done integer, ok integer, failed integer,
    upstream_failed integer, skipped integer, setups integer, setup_ok integer, setup_skipped integer,
    p_ratio double precision)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $$
SELECT CASE
    WHEN p_ratio IS NOT NULL AND rule = 'all_success' THEN
        CASE WHEN done >= total AND ok >= ceil(p_ratio * total) THEN 'READY'
             WHEN total - (failed + upstream_failed + skipped) < ceil(p_ratio * total) THEN
                 CASE WHEN failed + upstream_failed > 0 THEN 'UPSTREAM_FAILED' ELSE 'SKIPPED' END END
    ELSE CASE rule
    WHEN 'all_success' THEN CASE WHEN failed + upstream_failed > 0 THEN 'UPSTREAM_FAILED'
                                 WHEN skipped > 0 THEN 'SKIPPED'
                                 WHEN ok >= total THEN 'READY' END
    WHEN 'all_failed' THEN CASE WHEN ok + skipped > 0 THEN 'SKIPPED'
                                WHEN failed + upstream_failed >= total THEN 'READY' END
    WHEN 'all_done' THEN CASE WHEN done >= total THEN 'READY' END
    WHEN 'all_skipped' THEN CASE WHEN ok + failed + upstream_failed > 0 THEN 'SKIPPED'
                                 WHEN skipped >= total THEN 'READY' END
    WHEN 'one_success' THEN CASE WHEN ok > 0 THEN 'READY'
                                 WHEN done >= total AND done = skipped THEN 'SKIPPED'
                                 WHEN done >= total THEN 'UPSTREAM_FAILED' END
    WHEN 'one_failed' THEN CASE WHEN failed + upstream_failed > 0 THEN 'READY'
                                WHEN done >= total THEN 'SKIPPED' END
    WHEN 'one_done' THEN CASE WHEN ok + failed > 0 THEN 'READY'
                              WHEN done >= total THEN 'SKIPPED' END
    WHEN 'none_failed' THEN CASE WHEN failed + upstream_failed > 0 THEN 'UPSTREAM_FAILED'
                                 WHEN ok + skipped >= total THEN 'READY' END
    WHEN 'none_failed_min_one_success' THEN
        CASE WHEN failed + upstream_failed > 0 THEN 'UPSTREAM_FAILED'
             WHEN skipped >= total THEN 'SKIPPED'
             WHEN ok + skipped >= total THEN 'READY' END
    WHEN 'none_skipped' THEN CASE WHEN skipped > 0 THEN 'SKIPPED'
                                  WHEN done >= total THEN 'READY' END
    WHEN 'all_done_min_one_success' THEN
        CASE WHEN skipped > 0 THEN 'SKIPPED'
             WHEN done >= total AND ok > 0 THEN 'READY'
             WHEN done >= total THEN 'UPSTREAM_FAILED' END
    WHEN 'all_done_setup_success' THEN
        CASE WHEN done < total THEN NULL
             WHEN setups > 0 AND setup_skipped >= setups THEN 'SKIPPED'
             WHEN setups > 0 AND setup_ok = 0 THEN 'UPSTREAM_FAILED'
             ELSE 'READY' END
    WHEN 'always' THEN 'READY'
    END
END
$$;

-- orc_scope_verdict_v1: Airflow's setup constraint over a task's setup scope (orc_tasks.setup_scope:
-- the setups it works under without being their child). One of them FAILED, UPSTREAM_FAILED,
-- CANCELLED or DEAD_LETTER: UPSTREAM_FAILED; one SKIPPED: SKIPPED (whatever the task's own rule says,
-- and before it is decided); one not finished: NULL (the task waits: orc_settle_v2 decides it again
-- when that setup finishes, through the setup's scope_of); all succeeded: p_verdict, the rule's.

CREATE OR REPLACE FUNCTION orc_scope_verdict_v1(p_run text, p_setups text[], p_verdict text)
 RETURNS text
 LANGUAGE sql
 STABLE
AS $$
SELECT CASE
    WHEN count(*) FILTER (WHERE t.state IN ('FAILED', 'UPSTREAM_FAILED', 'CANCELLED', 'DEAD_LETTER')) > 0
        THEN 'UPSTREAM_FAILED'
    WHEN count(*) FILTER (WHERE t.state = 'SKIPPED') > 0 THEN 'SKIPPED'
    WHEN count(*) FILTER (WHERE t.state = 'SUCCEEDED') < cardinality(p_setups) THEN NULL
    ELSE p_verdict
END
FROM orc_tasks t WHERE t.run_id = p_run AND t.key = ANY (p_setups)
$$;
