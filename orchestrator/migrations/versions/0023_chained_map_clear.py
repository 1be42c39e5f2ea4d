"""A map chained item by item on a cleared map runs its children again instead of being
expanded again.

``orc_clear_v2`` changed in place: a map cleared without the task it maps over stays MAPPED and
runs its children again; a map chained item by item on it (``DAG.map`` over a mapped node) did
not: it was taken for a map whose source was cleared, its children removed, and it went back to
PENDING waiting on the first map's children, which count only into a chained map's children
(removed), so the run never finished. It now stays MAPPED too and its children wait again, each
on its item's child; it is still expanded again when the first map is (its source cleared).

Revision ID: 0023
Revises: 0022
"""

import importlib
import re

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(SQL)


def downgrade() -> None:
    # as migration 0015 installed it (no revision between changed it)
    text = importlib.import_module("orchestrator.migrations.versions.0015_waits_and_events").SQL
    found = re.search(r"-- orc_clear_v2:.*?\n\$\$;\n", text, re.S)
    assert found is not None
    op.execute(found.group(0))


#: orc_clear_v2 of store/sql/clear.sql as this revision installs it (frozen: a later change is a
#: later migration)
SQL = r"""
-- orc_clear_v2: an operator's clear: the tasks p_keys go back to be run again.
--
-- Under the run's row lock, each task of p_keys (the caller has resolved --downstream /
-- --upstream / --only-failed into the list) moves to PENDING with attempt + 1, whatever it held:
-- a QUEUED or RUNNING attempt is fenced by the new attempt (its claim, its heartbeat and its
-- outcome are refused and recorded), and an outcome it had stays in its ledger row (the event's
-- result). Maps: a map cleared with the parent it maps over is expanded again when that parent
-- succeeds again (its children removed now, each with a "removed" ledger row, never counted
-- again; the maps chained item by item on it too, and only those); a map cleared without it
-- stays MAPPED and runs again the children in p_keys (the caller lists them: all, or the failed
-- ones), and so does a map chained item by item on it (its children wait again, each on its
-- item's child, as when they were made: never on the whole map); a map child cleared on its
-- own runs again and its map, closed or not, counts it out (MAPPED). Then orc_redecide_v2
-- counts, reopens and decides. Returns how many tasks it cleared.

CREATE OR REPLACE FUNCTION orc_clear_v2(p_run text, p_keys text[], p_actor text, p_by text, p_reason text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    keys text[] := p_keys;
    again text[];
    removed int := 0;
    n int;
    h record;
BEGIN
    PERFORM 1 FROM orc_runs WHERE id = p_run FOR UPDATE;
    -- a map cleared with what it maps over is expanded again (and the maps chained item by item
    -- on it): its children are removed (their ledger rows stay, with a "removed" row each)
    again := ARRAY(
        WITH RECURSIVE r(key) AS (
            SELECT t.key FROM orc_tasks t
            WHERE t.run_id = p_run AND t.key = ANY (keys) AND t.map_spec IS NOT NULL
              AND t.map_spec->>'per_item' IS NULL AND EXISTS (
                SELECT 1 FROM json_array_elements(t.map_spec->'args') a WHERE a->>'from' = ANY (keys))
            UNION
            SELECT d.key FROM r JOIN orc_tasks d ON d.run_id = p_run AND d.map_spec->>'per_item' = r.key
        )
        SELECT key FROM r);
    keys := ARRAY(SELECT DISTINCT k FROM unnest(keys || again) AS k);
    IF cardinality(again) > 0 THEN
        WITH gone AS (
            DELETE FROM orc_tasks c WHERE c.run_id = p_run AND c.map_parent = ANY (again)
            RETURNING c.key, c.state, c.attempt, c.result
        ), logged AS (
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted,
                                         at, kind, result)
            SELECT p_run, g.key, g.attempt, g.state, g.state, p_actor, p_by,
                   'removed: its map is expanded again (' || p_reason || ')', true, now(), 'removed', g.result
            FROM gone g
            RETURNING 1
        )
        SELECT count(*) INTO removed FROM logged;
        UPDATE orc_tasks t SET map_total = 0, map_done = 0, map_ok = 0, map_failed = 0, map_skipped = 0,
            map_items = NULL, map_next = NULL, map_refill = NULL, map_max_active = NULL
        WHERE t.run_id = p_run AND t.key = ANY (again);
        UPDATE orc_runs SET task_count = task_count - removed WHERE id = p_run;
    END IF;
    WITH old AS (
        SELECT t.key, t.state, t.attempt, t.result FROM orc_tasks t
        WHERE t.run_id = p_run AND t.key = ANY (keys) ORDER BY t.key FOR UPDATE
    ), moved AS (
        UPDATE orc_tasks t SET state = 'PENDING', attempt = t.attempt + 1, result = NULL, error = NULL,
            finished_at = NULL, started_at = NULL, dispatched_at = NULL, heartbeat_at = NULL,
            lease_expires_at = NULL, worker = NULL, ready_at = NULL, not_before = NULL, skip_reason = NULL,
            fingerprint = NULL, fingerprint_streak = 0, lease_losses = 0,
            waiting = NULL, wait_event = NULL, wait_match = NULL, wake_at = NULL, wait_resume = NULL
        FROM old WHERE t.run_id = p_run AND t.key = old.key
        RETURNING t.key, t.attempt, old.state AS was, old.result AS had
    ), logged AS (
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at,
                                     result)
        SELECT p_run, m.key, m.attempt, m.was, 'PENDING', p_actor, p_by, p_reason, true, now(), m.had FROM moved m
        RETURNING 1
    )
    SELECT count(*) INTO n FROM logged;
    -- an expanded map whose children run again stays MAPPED, its counts taken again from them;
    -- so does a map some of whose children were cleared on their own (a closed one reopens)
    FOR h IN SELECT t.key, t.state, t.attempt FROM orc_tasks t
             WHERE t.run_id = p_run AND t.map_total > 0 AND NOT (t.key = ANY (again))
               AND (t.key = ANY (keys) OR t.key IN (SELECT c.map_parent FROM orc_tasks c
                                                  WHERE c.run_id = p_run AND c.key = ANY (keys)))
             ORDER BY t.key LOOP
        UPDATE orc_tasks t SET state = 'MAPPED', finished_at = NULL,
            map_done = x.done, map_ok = x.ok, map_failed = x.failed, map_skipped = x.skipped
        FROM (SELECT count(*) FILTER (WHERE c.state IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED')) AS done,
                     count(*) FILTER (WHERE c.state = 'SUCCEEDED') AS ok,
                     count(*) FILTER (WHERE c.state IN ('FAILED', 'UPSTREAM_FAILED')) AS failed,
                     count(*) FILTER (WHERE c.state = 'SKIPPED') AS skipped
              FROM orc_tasks c WHERE c.run_id = p_run AND c.map_parent = h.key) AS x
        WHERE t.run_id = p_run AND t.key = h.key;
        IF h.state <> 'MAPPED' THEN
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted,
                                         at)
            VALUES (p_run, h.key, (SELECT t.attempt FROM orc_tasks t WHERE t.run_id = p_run AND t.key = h.key),
                    CASE WHEN h.key = ANY (keys) THEN 'PENDING' ELSE h.state END, 'MAPPED', p_actor, p_by,
                    'its children run again (' || p_reason || ')', true, now());
        END IF;
    END LOOP;
    PERFORM orc_redecide_v2(p_run, keys, p_actor, p_by, p_reason);
    RETURN n;
END
$$;
"""
