"""Airflow's setup scope constraint: a task whose setup failed or was skipped anywhere above it
(a setup it works under without being its child) is UPSTREAM_FAILED or SKIPPED, whatever its rule.

``orc_tasks.setup_scope`` (a task's indirect setups: above it, not its parents, with no teardown
or one below it; written at submit) and ``orc_tasks.scope_of`` (on a setup: the tasks whose scope
names it). ``orc_scope_verdict_v1`` (new): a scope setup FAILED, UPSTREAM_FAILED, CANCELLED or
DEAD_LETTER gives UPSTREAM_FAILED, one SKIPPED gives SKIPPED, one unfinished holds the task;
else the rule's verdict. ``orc_settle_v2`` changed in place: a child with a scope is decided
through it, and a setup that finishes decides again the PENDING tasks of its scope_of (their
counters unchanged). ``orc_redecide_v2`` changed in place: a cleared task with a scope is decided
through it. Safe for a worker of the previous release: both columns are null on every task it
submits, and for those the functions do what they did.

Revision ID: 0028
Revises: 0027
"""

import importlib
import re

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("orc_tasks", sa.Column("setup_scope", postgresql.ARRAY(sa.Text), nullable=True))
    op.add_column("orc_tasks", sa.Column("scope_of", postgresql.ARRAY(sa.Text), nullable=True))
    op.execute(SQL)


def downgrade() -> None:
    # orc_settle_v2 as 0015 installed it, orc_redecide_v2 as 0025 did (no revision between changed them)
    for module, name in (("0015_waits_and_events", "orc_settle_v2"), ("0025_direct_short_circuit", "orc_redecide_v2")):
        text = importlib.import_module(f"orchestrator.store.migrations.versions.{module}").SQL
        found = re.search(rf"CREATE OR REPLACE FUNCTION {name}\(.*?\n\$\$;\n", text, re.S)
        assert found is not None, name
        op.execute(found.group(0))
    op.execute("DROP FUNCTION orc_scope_verdict_v1(text, text[], text)")
    op.drop_column("orc_tasks", "scope_of")
    op.drop_column("orc_tasks", "setup_scope")


#: orc_scope_verdict_v1 of store/sql/decide.sql, orc_settle_v2 of settle.sql and orc_redecide_v2 of
#: clear.sql as this revision installs them (frozen: a later change is a later migration)
SQL = r"""
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

-- orc_settle_v2: a task became terminal; count it into its children and decide them.
--
-- Adds the finished task to each child's counters (one UPDATE ... RETURNING per child, by
-- primary key: never a scan of the run), decides the child's trigger rule (orc_decide_v2),
-- moves decided children PENDING -> READY / SKIPPED / UPSTREAM_FAILED with their ledger rows
-- (a verdict reached before every parent is done says "early verdict"), expands a mapped child
-- whose rule says READY (orc_expand_v1) and begins a wait node's wait (orc_wait_v1) instead,
-- and cascades the terminal ones the same way. A task with a setup scope (orc_tasks.setup_scope,
-- Airflow's setup constraint) is decided by orc_scope_verdict_v1 over its rule's verdict, and a
-- setup that finishes decides again the PENDING tasks of its scope (its scope_of) that are not
-- its children, their counters unchanged.
-- A finished child of a map is also counted into its map's header: a wide map inserts its next
-- window of children (orc_map_window_v1), a map held by max_active admits its next waiting
-- child, and the header closes (MAPPED -> SUCCEEDED / FAILED /
-- SKIPPED, a summary that does not decide the run) after its last child. The run closes
-- (RUNNING -> SUCCEEDED / FAILED) when no task is left open: FAILED when a task that decides
-- the run (not a teardown, unless it asked to; not a map header) ended FAILED or
-- UPSTREAM_FAILED. The actor that caused the first change acts for the cascade.
-- Returns how many tasks it made READY (orc_succeed_v2 passes its slot on when none).

CREATE OR REPLACE FUNCTION orc_settle_v2(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    q_keys text[] := ARRAY[p_key];
    q_states text[] := ARRAY[p_state];
    q_children json[] := ARRAY[p_children];
    q_setup boolean[];
    q_parents text[];
    i int := 1;
    closed int := 1;
    readied int := 0;
    kids text[];
    kid text;
    direct int;
    j int;
    r record;
    m record;
    hdr record;
    verdict text;
    why text;
    expanded json;
    run_row record;
    failed int;
    outcome text;
BEGIN
    SELECT t.role = 'setup' AS setup, t.map_parent INTO r FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    q_setup := ARRAY[coalesce(r.setup, false)];
    q_parents := ARRAY[r.map_parent];
    WHILE i <= array_length(q_keys, 1) LOOP
        IF q_children[i] IS NOT NULL AND json_typeof(q_children[i]) = 'array' THEN
            kids := ARRAY(SELECT json_array_elements_text(q_children[i]));
            direct := cardinality(kids);
            IF q_setup[i] THEN
                -- a setup: the tasks of its scope that are not its children are decided again
                kids := kids || coalesce((SELECT t.scope_of FROM orc_tasks t
                                          WHERE t.run_id = p_run AND t.key = q_keys[i]), '{}');
            END IF;
            FOR j IN 1..cardinality(kids) LOOP
                kid := kids[j];
                IF j > direct THEN
                    SELECT t.key, t.state, t.attempt, t.trigger_rule, t.n_upstream, t.n_done, t.n_succeeded,
                           t.n_failed, t.n_upstream_failed, t.n_skipped, t.n_setup, t.n_setup_ok, t.n_setup_skipped,
                           t.min_success_ratio, t.map_spec IS NOT NULL AS mapped, t.flow = 'wait' AS waits,
                           t.setup_scope INTO r
                    FROM orc_tasks t WHERE t.run_id = p_run AND t.key = kid FOR UPDATE;
                ELSE
                UPDATE orc_tasks t SET
                    n_done = t.n_done + 1,
                    n_succeeded = t.n_succeeded + (q_states[i] = 'SUCCEEDED')::int,
                    n_failed = t.n_failed + (q_states[i] = 'FAILED')::int,
                    n_upstream_failed = t.n_upstream_failed + (q_states[i] = 'UPSTREAM_FAILED')::int,
                    n_skipped = t.n_skipped + (q_states[i] = 'SKIPPED')::int,
                    n_setup_ok = t.n_setup_ok + (q_setup[i] AND q_states[i] = 'SUCCEEDED')::int,
                    n_setup_skipped = t.n_setup_skipped + (q_setup[i] AND q_states[i] = 'SKIPPED')::int
                WHERE t.run_id = p_run AND t.key = kid
                RETURNING t.key, t.state, t.attempt, t.trigger_rule, t.n_upstream, t.n_done, t.n_succeeded,
                          t.n_failed, t.n_upstream_failed, t.n_skipped, t.n_setup, t.n_setup_ok, t.n_setup_skipped,
                          t.min_success_ratio, t.map_spec IS NOT NULL AS mapped, t.flow = 'wait' AS waits,
                          t.setup_scope INTO r;
                END IF;
                CONTINUE WHEN NOT FOUND OR r.state <> 'PENDING';
                verdict := orc_decide_v2(r.trigger_rule, r.n_upstream, r.n_done, r.n_succeeded, r.n_failed,
                                         r.n_upstream_failed, r.n_skipped, r.n_setup, r.n_setup_ok,
                                         r.n_setup_skipped, r.min_success_ratio);
                IF r.setup_scope IS NOT NULL THEN
                    verdict := orc_scope_verdict_v1(p_run, r.setup_scope, verdict);
                END IF;
                CONTINUE WHEN verdict IS NULL;
                why := CASE WHEN j > direct THEN 'setup ' ELSE 'upstream ' END || q_keys[i] || ' ' || q_states[i]
                       || CASE WHEN r.n_done < r.n_upstream
                               THEN '; early verdict (' || r.n_done || ' of ' || r.n_upstream || ' upstream done)'
                               ELSE '' END;
                IF verdict = 'READY' AND r.mapped THEN
                    expanded := orc_expand_v1(p_run, r.key, p_actor, p_by, why);
                    CONTINUE WHEN expanded IS NULL;
                    readied := readied + (expanded->>'readied')::int;
                    IF expanded->>'state' <> 'MAPPED' THEN
                        closed := closed + 1;
                        q_keys := q_keys || r.key;
                        q_states := q_states || (expanded->>'state');
                        q_children := q_children || (expanded->'children');
                        q_setup := q_setup || false;
                        q_parents := q_parents || NULL::text;
                    END IF;
                    CONTINUE;
                END IF;
                IF verdict = 'READY' AND r.waits THEN
                    -- a wait node waits as a row (orc_wait_v1); one whose event had come, or
                    -- whose instant is past, succeeds at once and is cascaded here
                    expanded := orc_wait_v1(p_run, r.key, p_actor, p_by, why);
                    CONTINUE WHEN expanded IS NULL OR expanded->>'state' = 'WAITING';
                    closed := closed + 1;
                    q_keys := q_keys || r.key;
                    q_states := q_states || (expanded->>'state');
                    q_children := q_children || (expanded->'children');
                    q_setup := q_setup || false;
                    q_parents := q_parents || NULL::text;
                    CONTINUE;
                END IF;
                UPDATE orc_tasks t SET
                    state = verdict,
                    ready_at = CASE WHEN verdict = 'READY' THEN coalesce(t.ready_at, now()) ELSE t.ready_at END,
                    finished_at = CASE WHEN verdict = 'READY' THEN t.finished_at ELSE now() END,
                    skip_reason = CASE WHEN verdict = 'SKIPPED' THEN 'upstream_skipped' ELSE t.skip_reason END
                WHERE t.run_id = p_run AND t.key = r.key AND coalesce(t.state, '') = 'PENDING'
                RETURNING t.key, t.attempt, t.children, t.role = 'setup' AS setup, t.map_parent INTO m;
                IF FOUND THEN
                    INSERT INTO orc_task_events
                        (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
                    VALUES (p_run, m.key, m.attempt, 'PENDING', verdict, p_actor, p_by, why, true, now());
                    IF verdict = 'READY' THEN
                        readied := readied + 1;
                    ELSE
                        closed := closed + 1;
                        q_keys := q_keys || m.key;
                        q_states := q_states || verdict;
                        q_children := q_children || m.children;
                        q_setup := q_setup || coalesce(m.setup, false);
                        q_parents := q_parents || m.map_parent;
                    END IF;
                ELSE
                    PERFORM orc_reject_v1(p_run, r.key, r.attempt, verdict, p_actor, why);
                END IF;
            END LOOP;
        END IF;
        IF q_parents[i] IS NOT NULL THEN
            -- a child of a map: counted into its header
            UPDATE orc_tasks t SET
                map_done = t.map_done + 1,
                map_ok = t.map_ok + (q_states[i] = 'SUCCEEDED')::int,
                map_failed = t.map_failed + (q_states[i] IN ('FAILED', 'UPSTREAM_FAILED'))::int,
                map_skipped = t.map_skipped + (q_states[i] = 'SKIPPED')::int
            WHERE t.run_id = p_run AND t.key = q_parents[i]
            RETURNING t.key, t.state, t.attempt, t.map_total, t.map_done, t.map_ok, t.map_failed, t.map_skipped,
                      t.map_max_active, t.map_refill INTO hdr;
            IF FOUND AND hdr.state = 'MAPPED' AND hdr.map_done >= hdr.map_refill THEN
                -- a wide map's next window of children
                readied := readied + orc_map_window_v1(p_run, hdr.key, p_actor, p_by);
            END IF;
            IF FOUND AND hdr.state = 'MAPPED' THEN
                IF hdr.map_done >= hdr.map_total THEN
                    outcome := CASE WHEN hdr.map_failed > 0 THEN 'FAILED'
                                    WHEN hdr.map_skipped >= hdr.map_total THEN 'SKIPPED' ELSE 'SUCCEEDED' END;
                    UPDATE orc_tasks t SET state = outcome, finished_at = now(),
                        skip_reason = CASE WHEN outcome = 'SKIPPED' THEN 'upstream_skipped' ELSE t.skip_reason END
                    WHERE t.run_id = p_run AND t.key = hdr.key AND t.state = 'MAPPED';
                    INSERT INTO orc_task_events
                        (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
                    VALUES (p_run, hdr.key, hdr.attempt, 'MAPPED', outcome, p_actor, p_by,
                            hdr.map_total || ' mapped task(s) done: ' || hdr.map_ok || ' succeeded, '
                            || hdr.map_failed || ' failed, ' || hdr.map_skipped || ' skipped', true, now());
                    closed := closed + 1;
                ELSIF hdr.map_max_active IS NOT NULL THEN
                    -- the next child held back by max_active
                    UPDATE orc_tasks t SET state = 'READY', ready_at = coalesce(t.ready_at, now())
                    WHERE (t.run_id, t.key) = (
                        SELECT w.run_id, w.key FROM orc_tasks w
                        WHERE w.run_id = p_run AND w.map_parent = hdr.key AND w.state = 'PENDING' AND w.n_upstream = 0
                        ORDER BY w.map_index LIMIT 1 FOR UPDATE SKIP LOCKED)
                    RETURNING t.key, t.attempt INTO m;
                    IF FOUND THEN
                        INSERT INTO orc_task_events
                            (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
                        VALUES (p_run, m.key, m.attempt, 'PENDING', 'READY', p_actor, p_by,
                                'map ' || hdr.key || ': a slot of max_active freed', true, now());
                        readied := readied + 1;
                    END IF;
                END IF;
            END IF;
        END IF;
        i := i + 1;
    END LOOP;
    UPDATE orc_runs SET open_tasks = open_tasks - closed WHERE id = p_run RETURNING open_tasks, state INTO run_row;
    IF FOUND AND run_row.open_tasks <= 0 AND run_row.state = 'RUNNING' THEN
        SELECT count(*) INTO failed FROM orc_tasks
        WHERE run_id = p_run AND state IN ('FAILED', 'UPSTREAM_FAILED') AND decides_run;
        outcome := CASE WHEN failed > 0 THEN 'FAILED' ELSE 'SUCCEEDED' END;
        UPDATE orc_runs SET state = outcome, finished_at = now() WHERE id = p_run AND state = 'RUNNING';
        IF FOUND THEN
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
            VALUES (p_run, NULL, 0, 'RUNNING', outcome, p_actor, p_by,
                    CASE WHEN failed > 0 THEN failed || ' task(s) failed'
                         ELSE 'every task succeeded or was skipped' END,
                    true, now());
        END IF;
    END IF;
    RETURN readied;
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
                    t.map_spec IS NOT NULL AS mapped, t.flow = 'wait' AS waits, t.setup_scope
             FROM orc_tasks t WHERE t.run_id = p_run AND t.key = ANY (targets) AND t.state = 'PENDING'
             ORDER BY t.key LOOP
        verdict := CASE WHEN r.n_upstream = 0 OR r.trigger_rule = 'always' THEN 'READY'
                        ELSE orc_decide_v2(r.trigger_rule, r.n_upstream, r.n_done, r.n_succeeded, r.n_failed,
                                           r.n_upstream_failed, r.n_skipped, r.n_setup, r.n_setup_ok,
                                           r.n_setup_skipped, r.min_success_ratio) END;
        IF r.setup_scope IS NOT NULL THEN
            -- its setup scope (a cleared setup runs again first: the task waits for it)
            verdict := orc_scope_verdict_v1(p_run, r.setup_scope, verdict);
        END IF;
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
