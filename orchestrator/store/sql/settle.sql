-- orc_settle_v4: a task became terminal; count it into its children and decide them.
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
-- A parent of a striped fan-in (p_stripe, orc_tasks.stripe: store/stripes.py) counts into its
-- stripe's row of orc_stripes instead of the join's: a success is held there (not counted into
-- the join, not closed in the run) until the arrival that fills the stripe, which adds the
-- stripe's held successes to the join and to the tasks it closes; a parent that did not succeed
-- is counted into the join at once. A stripe row is locked before the join's (the task-row
-- stage of the lock order). v4: v3 knew no stripes (v3 is a shim in legacy.sql).

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

-- orc_close_v1: p_closed tasks of the run closed (orc_settle_v4's count); the run closes
-- (RUNNING -> SUCCEEDED / FAILED) when no task is left open: FAILED when a task that decides the
-- run (not a teardown, unless it asked to; not a map header) ended FAILED or UPSTREAM_FAILED.
-- Called right after orc_settle_v4, before any admission, when it closed any (a success held
-- in a stripe closes none: the run's row is not written).
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

-- orc_settle_v2: orc_settle_v4 and orc_close_v1 in one call, for the callers that know only the
-- task's key (a skip, a wait's end, a clear's cascade, a submit's skipped roots, a failure): the
-- task's setup role, map header and stripe are read first. Returns how many tasks it made READY.

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
