"""Fewer statements per claim and per success (issue 35): the reads before the compare-and-set
folded into it, and each compare-and-set one statement with its ledger row.

- ``orc_settle_v3`` (new): ``orc_settle_v2``'s settlement, told by its caller whether the finished
  task is a setup and which map header it belongs to (read in the caller's own compare-and-set's
  RETURNING: no row read before the first write); it reads the children from the JSON list by
  index (expressions, not statements), moves a decided child with its ledger row in one statement,
  and returns how many tasks it made READY and how many it closed, without closing them in the run.
- ``orc_close_v1`` (new): those closed tasks taken off the run's open count, and the run closed
  when none is left; called right after the settlement, before any admission (the lock order
  every settling path keeps: task rows, the run's row, the admission locks).
- ``orc_succeed_v2`` changed in place: a task with no branch or short circuit that feeds no map
  succeeds in one statement, its compare-and-set and ledger row (a data-modifying WITH), with no
  row read before it (its node is read first only for the others, whose result is checked); then
  ``orc_settle_v3`` and ``orc_close_v1`` (called as expressions), the admission, the breakers.
  Same signature and result.
- ``orc_settle_v2`` changed in place: ``orc_settle_v3`` then ``orc_close_v1``, for its other callers;
  same signature and result.
- ``orc_claim_v2`` changed in place: its compare-and-set and ledger row in one statement.

``python bench/statements.py`` counts the statements per call (figures in bench/README.md). A worker
of the previous release calls the same functions and gets the same answers.

Revision ID: 0037
Revises: 0036
"""

import importlib
import re

from alembic import op

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(SQL)


def downgrade() -> None:
    # orc_succeed_v2 as 0018 installed it, orc_settle_v2 as 0028 and orc_claim_v2 as 0032 did (no
    # revision between changed them); the two new functions dropped
    for revision_module, name in (
        ("0018_circuit_breakers", "orc_succeed_v2"),
        ("0028_setup_scope", "orc_settle_v2"),
        ("0032_transactional_tasks", "orc_claim_v2"),
    ):
        text = importlib.import_module(f"orchestrator.store.migrations.versions.{revision_module}").SQL
        found = re.search(rf"CREATE OR REPLACE FUNCTION {name}\(.*?\n\$\$;\n", text, re.S)
        assert found is not None, f"{revision_module} defines {name}"
        op.execute(found.group(0))
    op.execute("DROP FUNCTION IF EXISTS orc_close_v1(text, integer, text, text)")
    op.execute("DROP FUNCTION IF EXISTS orc_settle_v3(text, text, text, json, text, text, boolean, text)")


#: the five functions of store/sql/settle.sql, succeed.sql and claim.sql as this revision installs them
#: (frozen: a later change is a later migration)
SQL = r"""
-- orc_settle_v3: a task became terminal; count it into its children and decide them.
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
-- SKIPPED, a summary that does not decide the run) after its last child. The actor that caused
-- the first change acts for the cascade.
-- The caller passes what it knows of the finished task (p_setup: it is a setup; p_map_parent:
-- its map's header), read in its own compare-and-set's RETURNING, so the settlement reads no row
-- it does not write. Returns how many tasks it made READY and how many it closed (the task
-- itself and its cascade): the caller closes them in the run with orc_close_v1 right after, before
-- any admission (the lock order every settling path keeps: task rows, the run's row, then the
-- admission locks).

CREATE OR REPLACE FUNCTION orc_settle_v3(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text, p_setup boolean, p_map_parent text, OUT readied integer, OUT closed integer)
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    q_keys text[] := ARRAY[p_key];
    q_states text[] := ARRAY[p_state];
    q_children json[] := ARRAY[p_children];
    q_setup boolean[] := ARRAY[coalesce(p_setup, false)];
    q_parents text[] := ARRAY[p_map_parent];
    i int := 1;
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
                WITH moved AS (
                    UPDATE orc_tasks t SET
                        state = verdict,
                        ready_at = CASE WHEN verdict = 'READY' THEN coalesce(t.ready_at, now()) ELSE t.ready_at END,
                        finished_at = CASE WHEN verdict = 'READY' THEN t.finished_at ELSE now() END,
                        skip_reason = CASE WHEN verdict = 'SKIPPED' THEN 'upstream_skipped' ELSE t.skip_reason END
                    WHERE t.run_id = p_run AND t.key = r.key AND coalesce(t.state, '') = 'PENDING'
                    RETURNING t.key, t.attempt, t.children, t.role = 'setup' AS setup, t.map_parent
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

-- orc_close_v1: p_closed tasks of the run closed (orc_settle_v3's count); the run closes
-- (RUNNING -> SUCCEEDED / FAILED) when no task is left open: FAILED when a task that decides the
-- run (not a teardown, unless it asked to; not a map header) ended FAILED or UPSTREAM_FAILED.
-- Called right after orc_settle_v3, before any admission.
-- Returns how many tasks of the run are left open (NULL: no such run), so that a caller can
-- call it as an expression (no statement of the executor's for the call itself).

CREATE OR REPLACE FUNCTION orc_close_v1(p_run text, p_closed integer, p_actor text, p_by text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    n_open int;
    run_state text;
    failed int;
    outcome text;
BEGIN
    UPDATE orc_runs SET open_tasks = open_tasks - p_closed WHERE id = p_run
    RETURNING open_tasks, state INTO n_open, run_state;
    IF n_open <= 0 AND run_state = 'RUNNING' THEN
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
    RETURN n_open;
END
$$;

-- orc_settle_v2: orc_settle_v3 and orc_close_v1 in one call, for the callers that know only the
-- task's key (a skip, a wait's end, a clear's cascade, a submit's skipped roots): the task's
-- setup role and map header are read first. Returns how many tasks it made READY.

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
    SELECT t.role = 'setup' AS setup, t.map_parent INTO r FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    s := orc_settle_v3(p_run, p_key, p_state, p_children, p_actor, p_by, r.setup, r.map_parent);
    open_left := orc_close_v1(p_run, s.closed, p_actor, p_by);
    RETURN s.readied;
END
$$;

-- orc_succeed_v2: RUNNING -> SUCCEEDED for p_attempt with the result, settled and admitted.
--
-- One statement, so one round trip in autocommit: the result checked (orc_result_problem_v1),
-- the compare-and-set and its ledger row, a branch's or short circuit's skips
-- (orc_follow_v1), the settlement (orc_settle_v3) and the run's count of open tasks
-- (orc_close_v1), then what to publish (orc_dispatch_v1), then, for a task that uses resources,
-- the call counted by their breakers (orc_breaker_v1; a task without resources, as every task an
-- earlier release wrote, costs one null check).
-- A task with no branch or short circuit that feeds no map (every task but those) is settled
-- from its compare-and-set alone: the UPDATE's RETURNING gives what the rest needs, no row is
-- read before it. The others read their node first, for the result's check. The
-- compare-and-set and its ledger row are one statement (a data-modifying WITH).
-- Returns {"accepted": true, "dispatches": [...]}, {"accepted": false, "conflict"} or, for a
-- result its node cannot use (nothing written), {"accepted": false, "invalid":
-- "BranchError: ..." | "MapError: ..."}: the worker then fails the attempt.

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
        RETURNING x.children, x.worker, x.resources, x.role = 'setup' AS setup, x.map_parent, x.flow
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
            RETURNING x.children, x.worker, x.resources, x.role = 'setup' AS setup, x.map_parent, x.flow
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
    s := orc_settle_v3(p_run, p_key, 'SUCCEEDED', t.children, 'worker', NULL, t.setup, t.map_parent);
    -- the run's row next, before the admission: every path that settles takes the run's row
    -- before the admission locks (a skip, a wait's end, a clear, a failure), so this one does too
    open_left := orc_close_v1(p_run, s.closed, 'worker', NULL);
    readied := readied + s.readied;
    dispatches := orc_dispatch_v1(readied, t.worker, p_window, p_worker_ttl, p_depth, p_aging);
    IF t.resources IS NOT NULL THEN
        PERFORM orc_breaker_v1(t.resources, p_run, p_key, p_attempt, false, NULL, 'worker');
    END IF;
    RETURN json_build_object('accepted', true, 'dispatches', dispatches);
END
$$;

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
"""
