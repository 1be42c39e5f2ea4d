"""Striped fan-ins (issue 35): a wide join's arrivals counted over several rows, so that its row
and the run's are written once per stripe instead of once per parent.

- ``orc_tasks.stripe`` (new column): a striped parent's stripe of its only child, set at submit.
- ``orc_stripes`` (new table): per join and stripe, its quota of parents, how many have arrived,
  how many successes are held (not yet counted into the join and the run), the last fold's size.
- ``orc_settle_v4`` (new): ``orc_settle_v3`` with the finished task's stripe: a success of a
  striped parent counts into its stripe only, and the arrival that fills a stripe adds the
  stripe's held successes to the join's counters and to the tasks it closes; a parent that did
  not succeed is counted into the join at once. ``orc_settle_v3`` becomes a shim in legacy.sql
  (its task's stripe read first).
- ``orc_succeed_v2`` and ``orc_settle_v2`` changed in place: ``orc_settle_v4`` with the stripe
  (from the compare-and-set's RETURNING, or read with the setup role), and ``orc_close_v1`` only
  when the settlement closed a task (a held success leaves the run's row unwritten).
- ``orc_redecide_v2`` changed in place: the held successes counted into their joins before the
  counts are taken again from the parents' states, then each stripe counted again the same way.

Same signatures and results for every function an earlier release calls.

Revision ID: 0038
Revises: 0037
"""

import importlib
import re

import sqlalchemy as sa
from alembic import op

revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("orc_tasks", sa.Column("stripe", sa.SmallInteger, nullable=True))
    op.create_table(
        "orc_stripes",
        sa.Column("run_id", sa.String(32), primary_key=True),
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("stripe", sa.SmallInteger, primary_key=True, autoincrement=False),
        sa.Column("quota", sa.Integer, nullable=False),
        sa.Column("arrived", sa.Integer, nullable=False, server_default="0"),
        sa.Column("pending", sa.Integer, nullable=False, server_default="0"),
        sa.Column("folded", sa.Integer, nullable=False, server_default="0"),
    )
    op.execute(SQL)


def downgrade() -> None:
    # orc_succeed_v2, orc_settle_v2 and orc_settle_v3 as 0037 installed them, orc_redecide_v2 as
    # 0028 installed it (no revision between changed them)
    for revision_module, name in (
        ("0037_settle_hot_rows", "orc_succeed_v2"),
        ("0037_settle_hot_rows", "orc_settle_v2"),
        ("0037_settle_hot_rows", "orc_settle_v3"),
        ("0028_setup_scope", "orc_redecide_v2"),
    ):
        text = importlib.import_module(f"orchestrator.store.migrations.versions.{revision_module}").SQL
        found = re.search(rf"CREATE OR REPLACE FUNCTION {name}\(.*?\n\$\$;\n", text, re.S)
        assert found is not None, f"{revision_module} defines {name}"
        op.execute(found.group(0))
    op.execute("DROP FUNCTION IF EXISTS orc_settle_v4(text, text, text, json, text, text, boolean, text, integer)")
    op.drop_table("orc_stripes")
    op.drop_column("orc_tasks", "stripe")


#: orc_settle_v4, orc_settle_v2 (store/sql/settle.sql), orc_succeed_v2 (succeed.sql), orc_redecide_v2
#: (clear.sql) and the orc_settle_v3 shim (legacy.sql) as this revision installs them (frozen: a
#: later change is a later migration)
SQL = r"""
CREATE OR REPLACE FUNCTION orc_settle_v4(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text, p_setup boolean, p_map_parent text, p_stripe integer, OUT readied integer, OUT closed integer)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    q_keys text[] := ARRAY[p_key];
    q_states text[] := ARRAY[p_state];
    q_children json[] := ARRAY[p_children];
    q_setup boolean[] := ARRAY[coalesce(p_setup, false)];
    q_parents text[] := ARRAY[p_map_parent];
    q_stripes int[] := ARRAY[p_stripe];
    i int := 1;
    d_done int;
    d_ok int;
    sp record;
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
    outcome text;
BEGIN
    closed := 1;
    readied := 0;
    WHILE i <= array_length(q_keys, 1) LOOP
        IF q_children[i] IS NOT NULL AND json_typeof(q_children[i]) = 'array' THEN
            -- the children read from the JSON list by index (expressions, not statements)
            direct := json_array_length(q_children[i]);
            kids := '{}';
            IF q_setup[i] THEN
                -- a setup: the tasks of its scope that are not its children are decided again
                kids := coalesce((SELECT t.scope_of FROM orc_tasks t
                                  WHERE t.run_id = p_run AND t.key = q_keys[i]), '{}');
            END IF;
            FOR j IN 1..direct + cardinality(kids) LOOP
                kid := CASE WHEN j <= direct THEN q_children[i] ->> (j - 1) ELSE kids[j - direct] END;
                IF j > direct THEN
                    SELECT t.key, t.state, t.attempt, t.trigger_rule, t.n_upstream, t.n_done, t.n_succeeded,
                           t.n_failed, t.n_upstream_failed, t.n_skipped, t.n_setup, t.n_setup_ok, t.n_setup_skipped,
                           t.min_success_ratio, t.map_spec IS NOT NULL AS mapped, t.flow = 'wait' AS waits,
                           t.setup_scope INTO r
                    FROM orc_tasks t WHERE t.run_id = p_run AND t.key = kid FOR UPDATE;
                ELSE
                d_ok := (q_states[i] = 'SUCCEEDED')::int;
                d_done := 1;
                IF q_stripes[i] IS NOT NULL THEN
                    UPDATE orc_stripes st SET arrived = st.arrived + 1,
                        pending = CASE WHEN st.arrived + 1 >= st.quota THEN 0 ELSE st.pending + d_ok END,
                        folded = CASE WHEN st.arrived + 1 >= st.quota THEN st.pending + d_ok ELSE 0 END
                    WHERE st.run_id = p_run AND st.key = kid AND st.stripe = q_stripes[i]
                    RETURNING st.arrived >= st.quota AS full, st.folded INTO sp;
                    IF FOUND THEN
                        IF NOT sp.full AND d_ok = 1 THEN
                            -- held in its stripe: neither the join's row nor the run's is written
                            closed := closed - 1;
                            CONTINUE;
                        END IF;
                        -- the stripe filled: its held successes (this one's among them) counted now
                        closed := closed + sp.folded - d_ok;
                        d_done := 1 - d_ok + sp.folded;
                        d_ok := sp.folded;
                    END IF;
                END IF;
                UPDATE orc_tasks t SET
                    n_done = t.n_done + d_done,
                    n_succeeded = t.n_succeeded + d_ok,
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
                        q_stripes := q_stripes || NULL::int;
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
                    q_stripes := q_stripes || NULL::int;
                    CONTINUE;
                END IF;
                WITH moved AS (
                    UPDATE orc_tasks t SET
                        state = verdict,
                        ready_at = CASE WHEN verdict = 'READY' THEN coalesce(t.ready_at, now()) ELSE t.ready_at END,
                        finished_at = CASE WHEN verdict = 'READY' THEN t.finished_at ELSE now() END,
                        skip_reason = CASE WHEN verdict = 'SKIPPED' THEN 'upstream_skipped' ELSE t.skip_reason END
                    WHERE t.run_id = p_run AND t.key = r.key AND coalesce(t.state, '') = 'PENDING'
                    RETURNING t.key, t.attempt, t.children, t.role = 'setup' AS setup, t.map_parent, t.stripe
                ), logged AS (
                    INSERT INTO orc_task_events
                        (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
                    SELECT p_run, mv.key, mv.attempt, 'PENDING', verdict, p_actor, p_by, why, true, now() FROM moved mv
                )
                SELECT mv.* INTO m FROM moved mv;
                IF FOUND THEN
                    IF verdict = 'READY' THEN
                        readied := readied + 1;
                    ELSE
                        closed := closed + 1;
                        q_keys := q_keys || m.key;
                        q_states := q_states || verdict;
                        q_children := q_children || m.children;
                        q_setup := q_setup || coalesce(m.setup, false);
                        q_parents := q_parents || m.map_parent;
                        q_stripes := q_stripes || m.stripe::int;
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
END
$$;

CREATE OR REPLACE FUNCTION orc_settle_v2(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    r record;
    s record;
    open_left int;
BEGIN
    SELECT t.role = 'setup' AS setup, t.map_parent, t.stripe INTO r FROM orc_tasks t
    WHERE t.run_id = p_run AND t.key = p_key;
    s := orc_settle_v4(p_run, p_key, p_state, p_children, p_actor, p_by, r.setup, r.map_parent, r.stripe);
    IF s.closed <> 0 THEN
        open_left := orc_close_v1(p_run, s.closed, p_actor, p_by);
    END IF;
    RETURN s.readied;
END
$$;

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
    -- a striped fan-in's successes still held in its stripes counted into their joins first:
    -- the counts below and the run's open tasks are taken again from the tasks' states
    UPDATE orc_tasks j SET n_done = j.n_done + h.n, n_succeeded = j.n_succeeded + h.n
    FROM (SELECT st.key, sum(st.pending)::int AS n FROM orc_stripes st
          WHERE st.run_id = p_run AND st.pending > 0 GROUP BY st.key) AS h
    WHERE j.run_id = p_run AND j.key = h.key;
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
    -- each stripe counted again from its parents' states: those that ended have arrived, none held
    UPDATE orc_stripes st SET arrived = c.n, pending = 0, folded = 0
    FROM (SELECT p.children ->> 0 AS key, p.stripe,
                 count(*) FILTER (WHERE p.state IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED'))::int AS n
          FROM orc_tasks p WHERE p.run_id = p_run AND p.stripe IS NOT NULL GROUP BY 1, 2) AS c
    WHERE st.run_id = p_run AND st.key = c.key AND st.stripe = c.stripe;
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

CREATE OR REPLACE FUNCTION orc_settle_v3(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text, p_setup boolean, p_map_parent text, OUT readied integer, OUT closed integer)
 LANGUAGE sql
AS $$
SELECT s.readied, s.closed
FROM orc_settle_v4(p_run, p_key, p_state, p_children, p_actor, p_by, p_setup, p_map_parent,
                   (SELECT t.stripe FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key)) AS s
$$;
"""
