"""Airflow's ``ShortCircuitOperator(ignore_downstream_trigger_rules=False)``: a short circuit whose
falsy result skips only its direct children (``orc_tasks.flow`` ``circuit_direct``), each settled
so that the tasks below follow their own trigger rules.

``orc_follow_v1`` changed in place: a ``circuit_direct`` flow skips the direct PENDING children
(reason ``short_circuit``) and settles each, as a branch settles the children it did not follow.
``orc_redecide_v2`` changed in place: a cleared task that is a direct child of such a short circuit
(not cleared, its result falsy) is skipped again, as one below a plain short circuit is; a task
further below is decided by its rule. Both are safe for a worker of the previous release: the new
flow value is written only by this release's submit, and every other task means what it meant.

Revision ID: 0025
Revises: 0024
"""

import importlib
import re

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(SQL)


def downgrade() -> None:
    # orc_follow_v1 as 0018 installed it, orc_redecide_v2 as 0023 did (no revision between changed them)
    for module, name in (("0018_circuit_breakers", "orc_follow_v1"), ("0023_chained_map_clear", "orc_redecide_v2")):
        text = importlib.import_module(f"orchestrator.store.migrations.versions.{module}").SQL
        found = re.search(rf"-- {name}:.*?\n\$\$;\n", text, re.S)
        assert found is not None, name
        op.execute(found.group(0))


#: orc_follow_v1 of store/sql/succeed.sql and orc_redecide_v2 of store/sql/clear.sql as this revision
#: installs them (frozen: a later change is a later migration)
SQL = r"""
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

-- orc_redecide_v2: after a clear or a mark, the counters of p_keys and of their PENDING
-- children are counted again from their parents' states (edges and map rows: never the whole
-- run; n_upstream too, a map expanded or not), the run's open tasks recounted (with the
-- children an open map's insert window has not made yet) and a final run reopened (RUNNING,
-- with its event) when it has tasks to run again or its outcome changed, then each PENDING
-- task of p_keys and their children is decided by its rule (orc_decide_v2; a root or an
-- "always" is READY; a child that a branch not cleared did not follow is SKIPPED again,
-- branch_not_taken; a task below a short circuit not cleared that returned a falsy result is
-- SKIPPED again, short_circuit, whatever its rule, as orc_follow_v1 skipped it; below one that
-- ignores no downstream rule, 'circuit_direct', only its direct children), a terminal
-- verdict settled (orc_settle_v2 cascades it and closes the run when nothing is left open).
-- v2: v1 knew no short circuit (a task cleared below one ran). Changed in place by 0025: the
-- direct short circuit.

CREATE OR REPLACE FUNCTION orc_redecide_v2(p_run text, p_keys text[], p_actor text, p_by text, p_reason text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    targets text[];
    r record;
    m record;
    verdict text;
    run_row record;
    readied int := 0;
    held text[];
BEGIN
    -- the tasks and their children (by each row's children: a map's child has no edges)
    targets := ARRAY(
        SELECT DISTINCT k FROM (
            SELECT unnest(p_keys) AS k
            UNION SELECT c.k FROM orc_tasks t, json_array_elements_text(coalesce(t.children, '[]'::json)) AS c(k)
                  WHERE t.run_id = p_run AND t.key = ANY (p_keys)
        ) AS x ORDER BY k);
    -- counted again from the parents: an expanded map counts as its children (relevant
    -- upstream), a chained map's child has its item's task as its parent, another map's child
    -- none (its map's parents were done when it was made)
    WITH tk AS (
        SELECT t.key, t.map_parent, t.map_item_from FROM orc_tasks t
        WHERE t.run_id = p_run AND t.key = ANY (targets) AND t.state = 'PENDING'
    ), par AS (
        SELECT tk.key AS child, e.parent_key AS parent FROM tk
        JOIN orc_edges e ON e.run_id = p_run AND e.child_key = tk.key WHERE tk.map_parent IS NULL
        UNION ALL SELECT tk.key, tk.map_item_from FROM tk WHERE tk.map_item_from IS NOT NULL
    ), units AS (
        SELECT par.child, p.state, p.role = 'setup' AS setup FROM par
        JOIN orc_tasks p ON p.run_id = p_run AND p.key = par.parent
        WHERE NOT (p.map_spec IS NOT NULL AND p.map_total > 0 AND p.state <> 'PENDING')
        UNION ALL
        SELECT par.child, c.state, false FROM par
        JOIN orc_tasks p ON p.run_id = p_run AND p.key = par.parent
        JOIN orc_tasks c ON c.run_id = p_run AND c.map_parent = p.key
        WHERE p.map_spec IS NOT NULL AND p.map_total > 0 AND p.state <> 'PENDING'
    ), sizes AS (
        SELECT par.child, sum(CASE WHEN p.map_spec IS NOT NULL AND p.map_total > 0 AND p.state <> 'PENDING'
                                   THEN p.map_total ELSE 1 END) AS n
        FROM par JOIN orc_tasks p ON p.run_id = p_run AND p.key = par.parent GROUP BY par.child
    ), x AS (
        SELECT tk.key, coalesce(z.n, 0) AS n,
               count(u.state) FILTER (WHERE u.state IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED')) AS done,
               count(u.state) FILTER (WHERE u.state = 'SUCCEEDED') AS ok,
               count(u.state) FILTER (WHERE u.state = 'FAILED') AS failed,
               count(u.state) FILTER (WHERE u.state = 'UPSTREAM_FAILED') AS upstream_failed,
               count(u.state) FILTER (WHERE u.state = 'SKIPPED') AS skipped,
               count(u.state) FILTER (WHERE u.state = 'SUCCEEDED' AND u.setup) AS setup_ok,
               count(u.state) FILTER (WHERE u.state = 'SKIPPED' AND u.setup) AS setup_skipped
        FROM tk LEFT JOIN units u ON u.child = tk.key LEFT JOIN sizes z ON z.child = tk.key
        GROUP BY tk.key, z.n
    )
    UPDATE orc_tasks c SET n_upstream = x.n,
        n_done = x.done, n_succeeded = x.ok, n_failed = x.failed, n_upstream_failed = x.upstream_failed,
        n_skipped = x.skipped, n_setup_ok = x.setup_ok, n_setup_skipped = x.setup_skipped
    FROM x WHERE c.run_id = p_run AND c.key = x.key AND c.state = 'PENDING';
    -- (with the children an open map's insert window has not made yet: its expansion counted
    -- all of them, and each is open until it is made and ends)
    UPDATE orc_runs u SET open_tasks = (
        SELECT count(*) FILTER (WHERE t.state NOT IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED',
                                                      'CANCELLED'))
               + coalesce(sum(t.map_total) FILTER (WHERE t.state = 'MAPPED'), 0)
               - count(*) FILTER (WHERE t.map_parent IS NOT NULL AND EXISTS (
                     SELECT 1 FROM orc_tasks h WHERE h.run_id = p_run AND h.key = t.map_parent
                       AND h.state = 'MAPPED'))
        FROM orc_tasks t WHERE t.run_id = p_run)
    WHERE u.id = p_run
    RETURNING u.state, u.open_tasks INTO run_row;
    IF run_row.state IN ('SUCCEEDED', 'FAILED') AND (run_row.open_tasks > 0 OR run_row.state <> CASE WHEN EXISTS (
            SELECT 1 FROM orc_tasks t WHERE t.run_id = p_run AND t.state IN ('FAILED', 'UPSTREAM_FAILED')
              AND t.decides_run) THEN 'FAILED' ELSE 'SUCCEEDED' END) THEN
        -- reopened: tasks to run again, or an outcome that a mark changed (closed again below)
        UPDATE orc_runs SET state = 'RUNNING', finished_at = NULL WHERE id = p_run;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, NULL, 0, run_row.state, 'RUNNING', p_actor, p_by, p_reason, true, now());
    END IF;
    -- a short circuit that was not cleared keeps its choice: a task below it (through any of its
    -- ancestors) when it returned a falsy result (null, false, 0, "", [], {}; one marked
    -- SUCCEEDED by hand has no result and chose nothing) is skipped again whatever its rule, all
    -- such tasks at once (settling one never decides another by its rule), then settled
    WITH RECURSIVE up(key, origin) AS (
        SELECT e.parent_key, e.child_key FROM orc_edges e
        JOIN orc_tasks c ON c.run_id = p_run AND c.key = e.child_key
        WHERE e.run_id = p_run AND e.child_key = ANY (targets) AND c.state = 'PENDING'
        UNION
        SELECT e.parent_key, up.origin FROM up JOIN orc_edges e ON e.run_id = p_run AND e.child_key = up.key
    ), skipped AS (
        UPDATE orc_tasks t SET state = 'SKIPPED', finished_at = now(), skip_reason = 'short_circuit'
        WHERE t.run_id = p_run AND t.state = 'PENDING' AND t.key IN (
            SELECT up.origin FROM up JOIN orc_tasks p ON p.run_id = p_run AND p.key = up.key
            WHERE p.state = 'SUCCEEDED' AND p.result IS NOT NULL
              AND (p.flow = 'short_circuit' OR p.flow = 'circuit_direct' AND EXISTS (
                  SELECT 1 FROM orc_edges d
                  WHERE d.run_id = p_run AND d.parent_key = p.key AND d.child_key = up.origin))
              AND CASE json_typeof(p.result)
                  WHEN 'null' THEN true WHEN 'boolean' THEN NOT (p.result #>> '{}')::boolean
                  WHEN 'number' THEN (p.result #>> '{}')::numeric = 0 WHEN 'string' THEN p.result #>> '{}' = ''
                  WHEN 'array' THEN json_array_length(p.result) = 0
                  ELSE NOT EXISTS (SELECT 1 FROM json_object_keys(p.result)) END)
        RETURNING t.key, t.attempt
    ), logged AS (
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        SELECT p_run, s.key, s.attempt, 'PENDING', 'SKIPPED', p_actor, p_by,
               'short_circuit: its short circuit keeps its choice (' || p_reason || ')', true, now()
        FROM skipped s
        RETURNING orc_task_events.key
    )
    SELECT array_agg(l.key ORDER BY l.key) INTO held FROM logged l;
    FOR m IN SELECT t.key, t.children FROM orc_tasks t
             WHERE t.run_id = p_run AND t.key = ANY (coalesce(held, '{}')) ORDER BY t.key LOOP
        readied := readied + orc_settle_v2(p_run, m.key, 'SKIPPED', m.children, p_actor, p_by);
    END LOOP;
    FOR r IN SELECT t.key, t.trigger_rule, t.n_upstream, t.n_done, t.n_succeeded, t.n_failed, t.n_upstream_failed,
                    t.n_skipped, t.n_setup, t.n_setup_ok, t.n_setup_skipped, t.min_success_ratio,
                    t.map_spec IS NOT NULL AS mapped, t.flow = 'wait' AS waits
             FROM orc_tasks t WHERE t.run_id = p_run AND t.key = ANY (targets) AND t.state = 'PENDING'
             ORDER BY t.key LOOP
        verdict := CASE WHEN r.n_upstream = 0 OR r.trigger_rule = 'always' THEN 'READY'
                        ELSE orc_decide_v2(r.trigger_rule, r.n_upstream, r.n_done, r.n_succeeded, r.n_failed,
                                           r.n_upstream_failed, r.n_skipped, r.n_setup, r.n_setup_ok,
                                           r.n_setup_skipped, r.min_success_ratio) END;
        CONTINUE WHEN verdict IS NULL;
        -- a branch that was not cleared keeps its choice: a child it did not follow is skipped again
        IF EXISTS (SELECT 1 FROM orc_edges e JOIN orc_tasks p ON p.run_id = e.run_id AND p.key = e.parent_key
                   WHERE e.run_id = p_run AND e.child_key = r.key AND p.flow = 'branch' AND p.state = 'SUCCEEDED'
                     AND NOT (p.result::jsonb = to_jsonb(r.key)
                              OR (jsonb_typeof(p.result::jsonb) = 'array' AND p.result::jsonb ? r.key))) THEN
            UPDATE orc_tasks t SET state = 'SKIPPED', finished_at = now(), skip_reason = 'branch_not_taken'
            WHERE t.run_id = p_run AND t.key = r.key AND t.state = 'PENDING'
            RETURNING t.key, t.attempt, t.children INTO m;
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            VALUES (p_run, m.key, m.attempt, 'PENDING', 'SKIPPED', p_actor, p_by,
                    'branch_not_taken: its branch keeps its choice (' || p_reason || ')', true, now());
            readied := readied + orc_settle_v2(p_run, m.key, 'SKIPPED', m.children, p_actor, p_by);
            CONTINUE;
        END IF;
        IF verdict = 'READY' AND r.waits THEN
            m := NULL;
            SELECT (orc_wait_v1(p_run, r.key, p_actor, p_by, p_reason)) AS x INTO m;
            IF m.x IS NOT NULL AND m.x->>'state' <> 'WAITING' THEN
                readied := readied + orc_settle_v2(p_run, r.key, m.x->>'state', m.x->'children', p_actor, p_by);
            END IF;
            CONTINUE;
        END IF;
        IF verdict = 'READY' AND r.mapped THEN
            m := NULL;
            SELECT (orc_expand_v1(p_run, r.key, p_actor, p_by, p_reason)) AS x INTO m;
            IF m.x IS NOT NULL AND m.x->>'state' <> 'MAPPED' THEN
                readied := readied + orc_settle_v2(p_run, r.key, m.x->>'state', m.x->'children', p_actor, p_by);
            ELSIF m.x IS NOT NULL THEN
                readied := readied + (m.x->>'readied')::int;
            END IF;
            CONTINUE;
        END IF;
        UPDATE orc_tasks t SET state = verdict,
            ready_at = CASE WHEN verdict = 'READY' THEN now() ELSE t.ready_at END,
            finished_at = CASE WHEN verdict = 'READY' THEN NULL ELSE now() END,
            skip_reason = CASE WHEN verdict = 'SKIPPED' THEN 'upstream_skipped' END
        WHERE t.run_id = p_run AND t.key = r.key AND t.state = 'PENDING'
        RETURNING t.key, t.attempt, t.children INTO m;
        CONTINUE WHEN NOT FOUND;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, m.key, m.attempt, 'PENDING', verdict, p_actor, p_by, p_reason, true, now());
        IF verdict = 'READY' THEN
            readied := readied + 1;
        ELSE
            readied := readied + orc_settle_v2(p_run, m.key, verdict, m.children, p_actor, p_by);
        END IF;
    END LOOP;
    -- nothing left open (every task it decided ended): close the run as settlement would
    SELECT state, open_tasks INTO run_row FROM orc_runs WHERE id = p_run;
    IF run_row.state = 'RUNNING' AND run_row.open_tasks <= 0 THEN
        UPDATE orc_runs SET state = CASE WHEN EXISTS (
                SELECT 1 FROM orc_tasks t WHERE t.run_id = p_run AND t.state IN ('FAILED', 'UPSTREAM_FAILED')
                  AND t.decides_run) THEN 'FAILED' ELSE 'SUCCEEDED' END,
            finished_at = now()
        WHERE id = p_run
        RETURNING state INTO verdict;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, NULL, 0, 'RUNNING', verdict, p_actor, p_by, p_reason || '; nothing left to run', true, now());
    END IF;
    RETURN readied;
END
$$;
"""
