-- orc_expand_v1: a mapped node whose trigger rule says READY becomes its children.
--
-- The items come from the node's map spec (orc_tasks.map_spec): each mapped argument is a
-- parent's JSON result (a list: keys are indexes; an object: keys are its keys and items its
-- values, or with "items" "pairs" [key, value] pairs; with "map_key", each item's own field) or a
-- literal list, without its null items when "skip_none" says so (a mapped parent, then: its
-- children's results once they are all done, the parent still MAPPED); several arguments are
-- zipped ("zip": to the shortest, or padded to the longest with "fill"; "zip_strict": equal
-- lengths) or crossed ("product"). An argument whose kwarg is "**" (kwargs_from) gives each
-- child its item's keys as keyword arguments (an object; with a "transform", the worker turns
-- the item first and spreads what it returns). The children, "<key>[<map key>]", are
-- inserted by one INSERT ... SELECT with the node's options and constant kwargs plus the
-- item as the mapped keyword (a map wider than its window, map_spec "window": the first window,
-- the rest later by orc_map_window_v1): READY (the first "max_active" of them when that is set, the
-- rest PENDING until a sibling finishes), with their ledger rows. A node mapped item by item
-- over this one (a chained map) is expanded at once with the same keys, each child PENDING on
-- its item. The mapped node itself moves PENDING -> MAPPED, each downstream node counts one
-- upstream per child, and the run's task counts grow. No items: the node ends SKIPPED
-- (on_empty "skip", reason empty_map) or SUCCEEDED with [] ("success"). A parent that did not
-- succeed: SKIPPED when it was skipped, else UPSTREAM_FAILED. Items that cannot map (not a list
-- or object, past max_length, zip_strict lengths that differ, a kwargs_from item that is not an
-- object, a key that is not a valid map key or is repeated): FAILED with a MapError, and the run
-- fails with it (unless map_spec "decides" is false: run_state "leaves"). Returns {"state", "readied",
-- "children"} (children: the node's downstream keys, for the caller's cascade when the state
-- is terminal), or NULL when the node is no longer PENDING.

CREATE OR REPLACE FUNCTION orc_map_items_v1(p_value json, p_key_field text)
 RETURNS jsonb
 LANGUAGE sql
 IMMUTABLE
AS $$
SELECT CASE json_typeof(p_value)
    WHEN 'array' THEN (
        SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'k', CASE WHEN p_key_field IS NULL THEN (e.o - 1)::text ELSE e.v::jsonb ->> p_key_field END,
                   'v', e.v) ORDER BY e.o), '[]'::jsonb)
        FROM json_array_elements(p_value) WITH ORDINALITY AS e(v, o))
    WHEN 'object' THEN (
        SELECT coalesce(jsonb_agg(jsonb_build_object('k', e.k, 'v', e.v) ORDER BY e.o), '[]'::jsonb)
        FROM json_each(p_value) WITH ORDINALITY AS e(k, v, o))
END
$$;

CREATE OR REPLACE FUNCTION orc_expand_v1(p_run text, p_key text, p_actor text, p_by text, p_why text)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    h record;
    arg json;
    src record;
    list jsonb;
    acc jsonb;
    n int;
    problem text;
    outcome text;
    combine text;
    readied int;
    win int;
    spread boolean;
    pad jsonb := '{}'::jsonb;
BEGIN
    SELECT t.map_spec, t.children, t.state, t.attempt INTO h FROM orc_tasks t
    WHERE t.run_id = p_run AND t.key = p_key FOR UPDATE;
    IF NOT FOUND OR h.state <> 'PENDING' THEN
        RETURN NULL;
    END IF;
    combine := coalesce(h.map_spec->>'combine', 'zip');
    FOR arg IN SELECT a FROM json_array_elements(h.map_spec->'args') AS a LOOP
        IF arg->>'from' IS NULL THEN
            list := orc_map_items_v1(arg->'items', h.map_spec->>'map_key');
        ELSE
            SELECT t.state, t.result, t.map_spec IS NOT NULL AS mapped INTO src FROM orc_tasks t
            WHERE t.run_id = p_run AND t.key = arg->>'from';
            -- a mapped parent still MAPPED: a map with skip_none waits for all its children (its
            -- rule said READY: they are done), not item by item
            IF src.state IS DISTINCT FROM 'SUCCEEDED' AND NOT (src.mapped AND src.state = 'MAPPED') THEN
                outcome := CASE WHEN src.state = 'SKIPPED' THEN 'SKIPPED' ELSE 'UPSTREAM_FAILED' END;
                problem := 'the mapped parent ' || (arg->>'from') || ' is ' || coalesce(src.state, 'missing');
                EXIT;
            END IF;
            IF src.mapped THEN
                -- the parent is a map that ended (on_empty, or after its children): its items are
                -- its children's results in map order
                SELECT coalesce(jsonb_agg(jsonb_build_object('k', c.map_key, 'v', c.result) ORDER BY c.map_index),
                                '[]'::jsonb) INTO list
                FROM orc_tasks c WHERE c.run_id = p_run AND c.map_parent = arg->>'from' AND c.state = 'SUCCEEDED';
            ELSE
                list := orc_map_items_v1(src.result, h.map_spec->>'map_key');
                IF h.map_spec->>'items' = 'pairs' AND json_typeof(src.result) = 'object' THEN
                    -- a mapping's [key, value] pairs (Airflow's), still keyed by its keys
                    list := (SELECT coalesce(jsonb_agg(jsonb_build_object('k', l.x->'k',
                                             'v', jsonb_build_array(l.x->'k', l.x->'v')) ORDER BY l.o), '[]'::jsonb)
                             FROM jsonb_array_elements(list) WITH ORDINALITY AS l(x, o));
                END IF;
            END IF;
        END IF;
        IF list IS NULL THEN
            outcome := 'FAILED';
            problem := 'MapError: ' || coalesce(arg->>'from', 'the literal items') || ' is not a JSON list or object';
            EXIT;
        END IF;
        IF (h.map_spec->>'skip_none')::boolean THEN
            list := (SELECT coalesce(jsonb_agg(l.x ORDER BY l.o), '[]'::jsonb)
                     FROM jsonb_array_elements(list) WITH ORDINALITY AS l(x, o)
                     WHERE jsonb_typeof(l.x->'v') IS DISTINCT FROM 'null');
        END IF;
        spread := arg->>'kwarg' = '**' AND h.map_spec->>'transform' IS NULL;
        IF spread THEN
            problem := (SELECT 'MapError: kwargs_from item ' || (l.o - 1) || ' of '
                               || coalesce(arg->>'from', 'the literal items') || ' is ' || left(l.x->>'v', 60)
                               || ', not an object of keyword arguments'
                        FROM jsonb_array_elements(list) WITH ORDINALITY AS l(x, o)
                        WHERE jsonb_typeof(l.x->'v') IS DISTINCT FROM 'object' ORDER BY l.o LIMIT 1);
            IF problem IS NOT NULL THEN
                outcome := 'FAILED';
                EXIT;
            END IF;
        END IF;
        IF acc IS NULL THEN
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object('k', l.x->'k', 'kw',
                                      CASE WHEN spread THEN l.x->'v'
                                           ELSE jsonb_build_object(arg->>'kwarg', l.x->'v') END) ORDER BY l.o),
                                  '[]'::jsonb)
                    FROM jsonb_array_elements(list) WITH ORDINALITY AS l(x, o));
        ELSIF combine = 'product' THEN
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                      'k', to_jsonb((a.x->>'k') || ',' || (l.x->>'k')),
                                      'kw', (a.x->'kw') || jsonb_build_object(arg->>'kwarg', l.x->'v'))
                                  ORDER BY a.o, l.o), '[]'::jsonb)
                    FROM jsonb_array_elements(acc) WITH ORDINALITY AS a(x, o)
                    CROSS JOIN jsonb_array_elements(list) WITH ORDINALITY AS l(x, o));
        ELSIF combine = 'zip_strict' AND jsonb_array_length(acc) <> jsonb_array_length(list) THEN
            outcome := 'FAILED';
            problem := 'MapError: zip of ' || jsonb_array_length(acc) || ' and ' || jsonb_array_length(list)
                       || ' items (' || (arg->>'kwarg') || '): combine zip_strict needs equal lengths';
            EXIT;
        ELSIF h.map_spec->'fill' IS NOT NULL THEN
            -- zip to the longest, the shorter arguments padded with the fill value
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                      'k', coalesce(a.x->'k', l.x->'k'),
                                      'kw', coalesce(a.x->'kw', pad) || jsonb_build_object(arg->>'kwarg',
                                            CASE WHEN l.o IS NULL THEN (h.map_spec->'fill'->'v')::jsonb
                                                 ELSE l.x->'v' END))
                                  ORDER BY coalesce(a.o, l.o)), '[]'::jsonb)
                    FROM jsonb_array_elements(acc) WITH ORDINALITY AS a(x, o)
                    FULL JOIN jsonb_array_elements(list) WITH ORDINALITY AS l(x, o) ON l.o = a.o);
        ELSE
            -- zip to the shortest (Python's and Airflow's zip)
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                      'k', a.x->'k',
                                      'kw', (a.x->'kw') || jsonb_build_object(arg->>'kwarg', l.x->'v'))
                                  ORDER BY a.o), '[]'::jsonb)
                    FROM jsonb_array_elements(acc) WITH ORDINALITY AS a(x, o)
                    JOIN jsonb_array_elements(list) WITH ORDINALITY AS l(x, o) ON l.o = a.o);
        END IF;
        pad := pad || jsonb_build_object(arg->>'kwarg', (h.map_spec->'fill'->'v')::jsonb);
    END LOOP;
    IF problem IS NULL THEN
        n := jsonb_array_length(acc);
        IF n > (h.map_spec->>'max_length')::int THEN
            outcome := 'FAILED';
            problem := 'MapError: ' || n || ' items exceed max_map_length ' || (h.map_spec->>'max_length');
        ELSE
            problem := (SELECT 'MapError: map key ' || coalesce(to_jsonb(x->>'k')::text, 'null') || ' of item '
                               || (o - 1) || ' is not 1-100 letters, digits or _ . , : = -'
                        FROM jsonb_array_elements(acc) WITH ORDINALITY AS a(x, o)
                        WHERE (x->>'k') IS NULL OR (x->>'k') !~ '^[A-Za-z0-9_.,:=-]{1,100}$'
                              OR length(p_key) + length(x->>'k') > 198
                        ORDER BY o LIMIT 1);
            IF problem IS NULL AND (SELECT count(DISTINCT x->>'k') FROM jsonb_array_elements(acc) AS a(x)) < n THEN
                problem := 'MapError: the items repeat a map key (' || (
                    SELECT x->>'k' FROM jsonb_array_elements(acc) AS a(x) GROUP BY 1 HAVING count(*) > 1 LIMIT 1)
                    || '); name unique keys with map_key';
            END IF;
            IF problem IS NOT NULL THEN
                outcome := 'FAILED';
            END IF;
        END IF;
    END IF;
    IF problem IS NULL AND n = 0 THEN
        outcome := CASE WHEN h.map_spec->>'on_empty' = 'success' THEN 'SUCCEEDED' ELSE 'SKIPPED' END;
        problem := 'no items to map (on_empty ' || coalesce(h.map_spec->>'on_empty', 'skip') || ')';
    END IF;
    IF problem IS NOT NULL THEN
        UPDATE orc_tasks t SET state = outcome, finished_at = now(),
            result = CASE WHEN outcome = 'SUCCEEDED' THEN '[]'::json ELSE t.result END,
            error = CASE WHEN outcome = 'FAILED' THEN problem ELSE t.error END,
            -- a map that could not expand fails its run (a header otherwise leaves that to its children)
            decides_run = (outcome = 'FAILED') AND coalesce((h.map_spec->>'decides')::boolean, true),
            skip_reason = CASE WHEN outcome <> 'SKIPPED' THEN NULL
                               WHEN left(problem, 8) = 'no items' THEN 'empty_map' ELSE 'upstream_skipped' END
        WHERE t.run_id = p_run AND t.key = p_key;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, p_key, h.attempt, 'PENDING', outcome, p_actor, p_by, p_why || '; ' || problem, true, now());
        RETURN json_build_object('state', outcome, 'readied', 0, 'children', h.children);
    END IF;
    win := coalesce((h.map_spec->>'window')::int, n);
    IF n > win THEN
        -- a wide map: the first window now, the rest by orc_map_window_v1 as children finish
        UPDATE orc_tasks t SET map_items = acc, map_next = win, map_refill = win - win / 2
        WHERE t.run_id = p_run AND t.key = p_key;
        acc := (SELECT jsonb_agg(acc -> i ORDER BY i) FROM generate_series(0, win - 1) AS i);
    END IF;
    readied := orc_map_insert_v1(p_run, p_key, acc, 0, n, NULL, p_actor, p_by, p_why);
    RETURN json_build_object('state', 'MAPPED', 'readied', readied, 'children', h.children);
END
$$;

-- orc_map_insert_v1: the rows of one expansion (orc_expand_v1's) or of one more window of it
-- (orc_map_window_v1's). p_items is the slice [{"k", "kw"}] that starts at map index p_offset of
-- p_total items; p_item_of, for a node mapped item by item, is the map whose child of the same
-- key holds each item (its result is passed at claim time). The first slice (p_offset 0) also
-- moves the node PENDING -> MAPPED with its total, widens its downstream's counters and grows
-- the run's task counts by p_total. Recurses into the nodes mapped item by item over this one,
-- with the same slice. Each child uses its node's resources (their circuit breakers) and is
-- transactional when its node is (orc_tasks.transactional). A node
-- expanded again (its map cleared with what it maps over: its attempt > 1, its old children
-- removed) never reuses an attempt of a key: each child's first attempt continues after the
-- highest one the ledger holds for its key in the run (one indexed look-up for the slice; a first
-- expansion skips it), and its max_attempts moves with it (the whole retry budget), so its
-- messages' Celery task ids <run>.<key>.<attempt> differ from every one an earlier generation
-- used (those the clear revoked too) and the claim's attempt fencing refuses their messages.
-- Returns how many children it made READY.

CREATE OR REPLACE FUNCTION orc_map_insert_v1(p_run text, p_key text, p_items jsonb, p_offset integer,
    p_total integer, p_item_of text, p_actor text, p_by text, p_why text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    h record;
    n int := jsonb_array_length(p_items);
    chained text[];
    plain json;
    cap int;
    readied int;
    c text;
    prior jsonb := '{}'::jsonb;
BEGIN
    SELECT t.* INTO h FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    IF h.attempt > 1 THEN
        -- expanded again: the attempts each key used before (a removed child's are in the ledger)
        prior := (SELECT coalesce(jsonb_object_agg(e.key, e.top), '{}'::jsonb) FROM (
                      SELECT e.key, max(e.attempt) AS top FROM orc_task_events e
                      WHERE e.run_id = p_run AND e.accepted AND e.key IN (
                          SELECT p_key || '[' || (x->>'k') || ']' FROM jsonb_array_elements(p_items) AS a(x))
                      GROUP BY e.key) AS e);
    END IF;
    -- the downstream nodes mapped item by item over this node, and the others
    chained := ARRAY(SELECT d.key FROM orc_tasks d
                     WHERE d.run_id = p_run AND d.key IN (SELECT json_array_elements_text(h.children))
                       AND d.map_spec->>'per_item' = p_key ORDER BY d.key);
    plain := (SELECT coalesce(json_agg(k), '[]'::json) FROM json_array_elements_text(h.children) AS k
              WHERE NOT (k = ANY (chained)));
    -- READY: the first max_active of the map (later ones wait PENDING for a sibling to finish),
    -- every child of a map without it; a child mapped item by item waits for its item
    cap := CASE WHEN p_item_of IS NOT NULL THEN 0
                WHEN h.map_spec->>'max_active' IS NULL THEN n
                ELSE greatest(0, (h.map_spec->>'max_active')::int - p_offset) END;
    INSERT INTO orc_tasks (run_id, key, task_name, args, kwargs, state, attempt, max_attempts, backoff, trigger_rule,
        n_upstream, n_done, n_succeeded, n_failed, n_upstream_failed, n_skipped, n_setup, n_setup_ok, n_setup_skipped,
        wants_upstream, queue, priority, priority_rank, tenant, soft_time_limit, time_limit, ready_at, children,
        retry_on, no_retry_on, fingerprint_streak, lease_losses, pool, pool_slots, rate_limit, deadline_seconds,
        deadline_at, decides_run, map_parent, map_index, map_key, map_item_from, map_total, map_done, map_ok,
        map_failed, map_skipped, resources, transactional)
    SELECT p_run, p_key || '[' || (x->>'k') || ']', h.task_name, h.args,
           CASE WHEN p_item_of IS NULL THEN (h.kwargs::jsonb || (x->'kw'))::json ELSE h.kwargs END,
           CASE WHEN o <= cap THEN 'READY' ELSE 'PENDING' END,
           1 + coalesce((prior->>(p_key || '[' || (x->>'k') || ']'))::int, 0),
           h.max_attempts + coalesce((prior->>(p_key || '[' || (x->>'k') || ']'))::int, 0), h.backoff, 'all_success',
           CASE WHEN p_item_of IS NULL THEN 0 ELSE 1 END, 0, 0, 0, 0, 0, 0, 0, 0,
           h.wants_upstream, h.queue, h.priority, h.priority_rank, h.tenant, h.soft_time_limit, h.time_limit,
           -- in map order, and an item's later stages as old as its first: a chained map runs
           -- item by item (admission takes the oldest READY first)
           now() + (p_offset + o - 1) * interval '1 microsecond',
           CASE WHEN cardinality(chained) = 0 THEN plain
                ELSE (SELECT json_agg(v) FROM (
                          SELECT json_array_elements(plain) AS v
                          UNION ALL SELECT to_json(cc || '[' || (x->>'k') || ']') FROM unnest(chained) AS cc) AS kk)
           END,
           h.retry_on, h.no_retry_on, 0, 0, h.pool, h.pool_slots, h.rate_limit, h.deadline_seconds, h.deadline_at,
           coalesce((h.map_spec->>'decides')::boolean, true), p_key, (p_offset + o - 1)::int, x->>'k',
           CASE WHEN p_item_of IS NULL THEN NULL ELSE p_item_of || '[' || (x->>'k') || ']' END, 0, 0, 0, 0, 0,
           h.resources, h.transactional
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(x, o);
    readied := LEAST(cap, n);
    IF readied > 0 THEN
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        SELECT p_run, p_key || '[' || (x->>'k') || ']',
               1 + coalesce((prior->>(p_key || '[' || (x->>'k') || ']'))::int, 0), 'PENDING', 'READY', p_actor, p_by,
               'mapped from ' || p_key || ' (item ' || (p_offset + o - 1) || ')', true, now()
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(x, o) WHERE o <= cap;
    END IF;
    IF p_offset = 0 THEN
        -- each downstream node counts the children instead of the node
        IF p_total <> 1 AND json_array_length(plain) > 0 THEN
            UPDATE orc_tasks d SET n_upstream = d.n_upstream + p_total - 1
            WHERE d.run_id = p_run AND d.key IN (SELECT json_array_elements_text(plain));
        END IF;
        UPDATE orc_tasks t SET state = 'MAPPED', map_total = p_total, map_done = 0, map_ok = 0, map_failed = 0,
                               map_skipped = 0, map_max_active = (h.map_spec->>'max_active')::int
        WHERE t.run_id = p_run AND t.key = p_key;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, p_key, h.attempt, 'PENDING', 'MAPPED', p_actor, p_by,
                coalesce(p_why || '; ', '') || 'mapped into ' || p_total || ' task(s)'
                || CASE WHEN p_item_of IS NULL THEN '' ELSE ' item by item over ' || p_item_of END
                || CASE WHEN n < p_total THEN ', the first ' || n || ' now, the rest in windows' ELSE '' END,
                true, now());
        UPDATE orc_runs SET task_count = task_count + p_total, open_tasks = open_tasks + p_total WHERE id = p_run;
    END IF;
    FOREACH c IN ARRAY chained LOOP
        readied := readied + orc_map_insert_v1(p_run, c, (
            SELECT jsonb_agg(jsonb_build_object('k', x->'k', 'kw', '{}'::jsonb) ORDER BY o)
            FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(x, o)), p_offset, p_total, p_key, p_actor, p_by,
            NULL);
    END LOOP;
    RETURN readied;
END
$$;

-- orc_map_window_v1: the next window of a wide map's children. A map of more items than its
-- window (map_spec "window") inserts the first window at expansion and keeps the rest in
-- map_items; when its unfinished materialised children fall to half a window (orc_settle_v2
-- checks on each child that finishes), the next window is inserted the same way (its items
-- sliced out of map_items in one read). Returns how many children it made READY.

CREATE OR REPLACE FUNCTION orc_map_window_v1(p_run text, p_key text, p_actor text, p_by text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    h record;
    w int;
    slice jsonb;
    readied int;
BEGIN
    SELECT t.map_items, t.map_next, t.map_total, t.map_spec INTO h FROM orc_tasks t
    WHERE t.run_id = p_run AND t.key = p_key AND t.state = 'MAPPED' FOR UPDATE;
    IF NOT FOUND OR h.map_items IS NULL OR h.map_next >= h.map_total THEN
        RETURN 0;
    END IF;
    w := LEAST((h.map_spec->>'window')::int, h.map_total - h.map_next);
    -- one read of the stored items (a jsonpath slice): an element read by index from the record
    -- reads the whole TOASTed list each time (16 s for a window of 10,000 of 100,000 items)
    slice := jsonb_path_query_array(h.map_items,
                                    ('$[' || h.map_next || ' to ' || (h.map_next + w - 1) || ']')::jsonpath);
    UPDATE orc_tasks t SET map_next = h.map_next + w,
                           map_items = CASE WHEN h.map_next + w >= h.map_total THEN NULL ELSE t.map_items END,
                           -- the next window once half of this one is done (none after the last)
                           map_refill = CASE WHEN h.map_next + w >= h.map_total THEN NULL
                                             ELSE h.map_next + w - (h.map_spec->>'window')::int / 2 END
    WHERE t.run_id = p_run AND t.key = p_key;
    readied := orc_map_insert_v1(p_run, p_key, slice, h.map_next, h.map_total, NULL, p_actor, p_by, NULL);
    RETURN readied;
END
$$;
