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
    owed bigint := 0;
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
        -- the run counted every child of those maps at their expansion, made or not yet
        owed := (SELECT coalesce(sum(a.map_total), 0) FROM orc_tasks a
                 WHERE a.run_id = p_run AND a.key = ANY (again) AND a.state = 'MAPPED')
                - (SELECT count(*) FROM orc_tasks c JOIN orc_tasks a ON a.run_id = p_run AND a.key = c.map_parent
                   WHERE c.run_id = p_run AND c.map_parent = ANY (again) AND a.state = 'MAPPED');
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
        UPDATE orc_runs SET task_count = task_count - removed - owed WHERE id = p_run;
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

-- orc_mark_v2: an operator sets a task's outcome by hand (Airflow's Mark Success / Mark Failed):
-- SUCCEEDED, FAILED or SKIPPED. A QUEUED or RUNNING attempt is fenced (attempt + 1). The tasks
-- below it that its old outcome decided without running them (UPSTREAM_FAILED or SKIPPED by
-- their rule, never started) go back to PENDING, and orc_redecide_v2 decides them again with
-- its new outcome: its children follow their trigger rules. A map's child is counted again into
-- its map, which closes or reopens as its children say. Returns the state it held.

CREATE OR REPLACE FUNCTION orc_mark_v2(p_run text, p_key text, p_state text, p_actor text, p_by text)
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    t record;
    hdr record;
    undone text[];
    why text := 'marked ' || p_state || ' by hand';
BEGIN
    PERFORM 1 FROM orc_runs WHERE id = p_run FOR UPDATE;
    SELECT x.state, x.attempt, x.children, x.map_parent,
           (SELECT h.state FROM orc_tasks h WHERE h.run_id = p_run AND h.key = x.map_parent) AS header_state
    INTO t FROM orc_tasks x WHERE x.run_id = p_run AND x.key = p_key FOR UPDATE;
    -- what its outcome decided without running it, transitively
    WITH RECURSIVE below(key) AS (
        SELECT k FROM json_array_elements_text(coalesce(t.children, '[]'::json)) AS k
        UNION
        SELECT c.k FROM below JOIN orc_tasks b ON b.run_id = p_run AND b.key = below.key,
             json_array_elements_text(coalesce(b.children, '[]'::json)) AS c(k)
        WHERE b.state IN ('UPSTREAM_FAILED', 'SKIPPED') AND b.started_at IS NULL
    )
    SELECT array_agg(b.key ORDER BY b.key) INTO undone
    FROM below JOIN orc_tasks b ON b.run_id = p_run AND b.key = below.key
    WHERE b.state IN ('UPSTREAM_FAILED', 'SKIPPED') AND b.started_at IS NULL;
    WITH moved AS (
        UPDATE orc_tasks b SET state = 'PENDING', finished_at = NULL, skip_reason = NULL
        WHERE b.run_id = p_run AND b.key = ANY (coalesce(undone, '{}'))
        RETURNING b.key, b.attempt
    )
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    SELECT p_run, m.key, m.attempt, (SELECT e.to_state FROM orc_task_events e WHERE e.run_id = p_run AND e.key = m.key
                                     AND e.accepted ORDER BY e.id DESC LIMIT 1),
           'PENDING', p_actor, p_by, 'decided again: ' || p_key || ' ' || why, true, now()
    FROM moved m;
    UPDATE orc_tasks x SET state = p_state, finished_at = now(), lease_expires_at = NULL,
        wait_event = NULL, wait_match = NULL, wake_at = NULL,
        attempt = x.attempt + (x.state IN ('QUEUED', 'RUNNING'))::int,
        skip_reason = CASE WHEN p_state = 'SKIPPED' THEN 'user' END,
        error = CASE WHEN p_state = 'FAILED' THEN coalesce(x.error, why) END
    WHERE x.run_id = p_run AND x.key = p_key;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    SELECT p_run, p_key, x.attempt, t.state, p_state, p_actor, p_by, why, true, now()
    FROM orc_tasks x WHERE x.run_id = p_run AND x.key = p_key;
    IF t.map_parent IS NOT NULL THEN
        -- a map's child: its map counts it again, and closes (or reopens) as its children say
        UPDATE orc_tasks h SET map_done = x.done, map_ok = x.ok, map_failed = x.failed, map_skipped = x.skipped,
            state = CASE WHEN x.done < h.map_total THEN 'MAPPED' WHEN x.failed > 0 THEN 'FAILED'
                         WHEN x.skipped >= h.map_total THEN 'SKIPPED' ELSE 'SUCCEEDED' END,
            finished_at = CASE WHEN x.done < h.map_total THEN NULL ELSE now() END
        FROM (SELECT count(*) FILTER (WHERE c.state IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED')) AS done,
                     count(*) FILTER (WHERE c.state = 'SUCCEEDED') AS ok,
                     count(*) FILTER (WHERE c.state IN ('FAILED', 'UPSTREAM_FAILED')) AS failed,
                     count(*) FILTER (WHERE c.state = 'SKIPPED') AS skipped
              FROM orc_tasks c WHERE c.run_id = p_run AND c.map_parent = t.map_parent) AS x
        WHERE h.run_id = p_run AND h.key = t.map_parent
        RETURNING h.key, h.attempt, h.state INTO hdr;
        IF hdr.state IS DISTINCT FROM t.header_state THEN
            INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted,
                                         at)
            VALUES (p_run, hdr.key, hdr.attempt, t.header_state, hdr.state, p_actor, p_by,
                    'its child ' || p_key || ' ' || why, true, now());
        END IF;
    END IF;
    PERFORM orc_redecide_v2(p_run, ARRAY(SELECT json_array_elements_text(coalesce(t.children, '[]'::json)))
                                   || coalesce(undone, '{}'), p_actor, p_by, why);
    RETURN t.state;
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
-- direct short circuit; by 0038: a striped fan-in's held successes counted into their joins
-- first, and each stripe counted again from its parents' states.

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
