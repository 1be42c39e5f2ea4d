"""Dynamic DAGs: maps, branches and skips, Airflow's 13 trigger rules, setup and teardown.

``orc_tasks`` gains the columns of mapping (a mapped node's ``map_spec``, a wide map's
``map_items`` / ``map_next``, its children's ``map_parent`` / ``map_index`` / ``map_key`` /
``map_item_from``, the header's counts), of branches
and skips (``flow``, ``feeds_map``, ``skip_reason``), of the new rules' counters
(``n_upstream_failed`` apart from ``n_failed``; ``n_setup`` .. ``n_setup_skipped``;
``min_success_ratio``), of setup and teardown (``role``, ``decides_run``), a wider
``trigger_rule`` and a partial index of the maps' children. The server functions of this
release are installed from a frozen copy of ``store/sql/``: ``orc_decide_v2``, ``orc_settle_v2``,
``orc_claim_v2``, ``orc_succeed_v2`` and the new ``orc_expand_v1``, ``orc_map_items_v1``,
``orc_map_insert_v1``, ``orc_map_window_v1``, ``orc_result_problem_v1``, ``orc_follow_v1``, ``orc_dispatch_v1``,
``orc_skip_v1``; ``orc_claim_v1``, ``orc_succeed_v1`` and ``orc_settle_v1`` become shims over
their ``_v2`` (a worker of the previous release keeps working during a rolling upgrade) and
``orc_decide_v1`` goes. The open tasks' ``n_failed`` is split: their UPSTREAM_FAILED parents move
to ``n_upstream_failed``.

Revision ID: 0011
Revises: 0010
"""

import importlib

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

COUNTS = ("n_upstream_failed", "n_setup", "n_setup_ok", "n_setup_skipped", "map_total", "map_done", "map_ok",
          "map_failed", "map_skipped")  # fmt: skip
NEW_SIGNATURES = (
    "orc_decide_v2(text, integer, integer, integer, integer, integer, integer, integer, integer, integer,"
    " double precision)",
    "orc_map_items_v1(json, text)",
    "orc_expand_v1(text, text, text, text, text)",
    "orc_map_insert_v1(text, text, jsonb, integer, integer, text, text, text, text)",
    "orc_map_window_v1(text, text, text, text)",
    "orc_settle_v2(text, text, text, json, text, text)",
    "orc_claim_v2(text, text, integer, text, double precision, text)",
    "orc_succeed_v2(text, text, integer, json, integer, double precision, integer, double precision)",
    "orc_result_problem_v1(text, text, json)",
    "orc_follow_v1(text, text, text, json, json, text, text)",
    "orc_dispatch_v1(integer, text, integer, double precision, integer, double precision)",
    "orc_skip_v1(text, text, integer, text, integer, double precision, integer, double precision)",
)
DROPPED = ("orc_decide_v1(text, integer, integer, integer, integer, integer)",)
#: the _v1 functions this revision turns into shims (CREATE OR REPLACE cannot change a
#: function's language: they are dropped and created again)
RESHAPED = (
    "orc_claim_v1(text, text, integer, text, double precision, text)",
    "orc_succeed_v1(text, text, integer, json, integer, double precision, integer, double precision)",
    "orc_settle_v1(text, text, text, json, text, text)",
)


def upgrade() -> None:
    op.alter_column("orc_tasks", "trigger_rule", existing_type=sa.String(16), type_=sa.String(32))
    for name in COUNTS:
        op.add_column("orc_tasks", sa.Column(name, sa.Integer, nullable=False, server_default="0"))
    op.add_column("orc_tasks", sa.Column("role", sa.String(16), nullable=True))
    op.add_column("orc_tasks", sa.Column("decides_run", sa.Boolean, nullable=False, server_default=sa.true()))
    op.add_column("orc_tasks", sa.Column("flow", sa.String(16), nullable=True))
    op.add_column("orc_tasks", sa.Column("feeds_map", sa.Boolean, nullable=False, server_default=sa.false()))
    op.add_column("orc_tasks", sa.Column("skip_reason", sa.String(32), nullable=True))
    op.add_column("orc_tasks", sa.Column("min_success_ratio", sa.Float, nullable=True))
    op.add_column("orc_tasks", sa.Column("map_spec", sa.JSON, nullable=True))
    op.add_column("orc_tasks", sa.Column("map_parent", sa.String(200), nullable=True))
    op.add_column("orc_tasks", sa.Column("map_index", sa.Integer, nullable=True))
    op.add_column("orc_tasks", sa.Column("map_key", sa.String(100), nullable=True))
    op.add_column("orc_tasks", sa.Column("map_item_from", sa.String(200), nullable=True))
    op.add_column("orc_tasks", sa.Column("map_items", postgresql.JSONB, nullable=True))
    op.add_column("orc_tasks", sa.Column("map_next", sa.Integer, nullable=True))
    op.add_column("orc_tasks", sa.Column("map_max_active", sa.Integer, nullable=True))
    op.add_column("orc_tasks", sa.Column("map_refill", sa.Integer, nullable=True))
    op.create_index(
        "ix_orc_tasks_map_children",
        "orc_tasks",
        ["run_id", "map_parent", "map_index"],
        postgresql_where=sa.text("map_parent IS NOT NULL AND state IN ('PENDING', 'SUCCEEDED')"),
    )
    # n_failed now counts FAILED parents only: the open tasks' UPSTREAM_FAILED parents move over
    op.execute(
        """
        UPDATE orc_tasks c SET n_upstream_failed = u.n, n_failed = c.n_failed - u.n
        FROM (SELECT e.run_id, e.child_key, count(*) AS n FROM orc_edges e
              JOIN orc_tasks p ON p.run_id = e.run_id AND p.key = e.parent_key
              WHERE p.state = 'UPSTREAM_FAILED' GROUP BY 1, 2) u
        WHERE c.run_id = u.run_id AND c.key = u.child_key AND c.state = 'PENDING'
        """
    )
    for signature in RESHAPED + DROPPED:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.execute(SQL)


def downgrade() -> None:
    # 0009's functions (their _v1 bodies and the unversioned shims), then this revision's go
    for signature in RESHAPED:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.execute(importlib.import_module("orchestrator.store.migrations.versions.0009_versioned_functions").SQL)
    for signature in NEW_SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.execute(
        "UPDATE orc_tasks SET n_failed = n_failed + n_upstream_failed WHERE state = 'PENDING' AND n_upstream_failed > 0"
    )
    op.drop_index("ix_orc_tasks_map_children", table_name="orc_tasks")
    for name in ("role", "decides_run", "flow", "feeds_map", "skip_reason", "min_success_ratio", "map_spec",
                 "map_parent", "map_index", "map_key", "map_item_from", "map_items", "map_next",
                 "map_max_active", "map_refill",
                 *COUNTS):  # fmt: skip
        op.drop_column("orc_tasks", name)
    op.alter_column("orc_tasks", "trigger_rule", existing_type=sa.String(32), type_=sa.String(16))


#: the files of store/sql/ this revision changes, as it installs them (frozen: a later change is a
#: later migration); reject, limit_held, admit_from, pass_slot and admit are as 0009 installed them
SQL = r"""
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

-- orc_expand_v1: a mapped node whose trigger rule says READY becomes its children.
--
-- The items come from the node's map spec (orc_tasks.map_spec): each mapped argument is a
-- parent's JSON result (a list: keys are indexes; an object: keys are its keys and items its
-- values; with "map_key", each item's own field) or a literal list; several arguments are
-- zipped (equal lengths) or crossed ("product"). The children, "<key>[<map key>]", are
-- inserted by one INSERT ... SELECT with the node's options and constant kwargs plus the
-- item as the mapped keyword (a map wider than its window, map_spec "window": the first window,
-- the rest later by orc_map_window_v1): READY (the first "max_active" of them when that is set, the
-- rest PENDING until a sibling finishes), with their ledger rows. A node mapped item by item
-- over this one (a chained map) is expanded at once with the same keys, each child PENDING on
-- its item. The mapped node itself moves PENDING -> MAPPED, each downstream node counts one
-- upstream per child, and the run's task counts grow. No items: the node ends SKIPPED
-- (on_empty "skip", reason empty_map) or SUCCEEDED with [] ("success"). A parent that did not
-- succeed: SKIPPED when it was skipped, else UPSTREAM_FAILED. Items that cannot map (not a list
-- or object, past max_length, zip lengths that differ, a key that is not a valid map key or is
-- repeated): FAILED with a MapError, and the run fails with it. Returns {"state", "readied",
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
            IF src.state IS DISTINCT FROM 'SUCCEEDED' THEN
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
            END IF;
        END IF;
        IF list IS NULL THEN
            outcome := 'FAILED';
            problem := 'MapError: ' || coalesce(arg->>'from', 'the literal items') || ' is not a JSON list or object';
            EXIT;
        END IF;
        IF acc IS NULL THEN
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object('k', l.x->'k', 'kw',
                                      jsonb_build_object(arg->>'kwarg', l.x->'v')) ORDER BY l.o), '[]'::jsonb)
                    FROM jsonb_array_elements(list) WITH ORDINALITY AS l(x, o));
        ELSIF combine = 'product' THEN
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                      'k', to_jsonb((a.x->>'k') || ',' || (l.x->>'k')),
                                      'kw', (a.x->'kw') || jsonb_build_object(arg->>'kwarg', l.x->'v'))
                                  ORDER BY a.o, l.o), '[]'::jsonb)
                    FROM jsonb_array_elements(acc) WITH ORDINALITY AS a(x, o)
                    CROSS JOIN jsonb_array_elements(list) WITH ORDINALITY AS l(x, o));
        ELSE
            IF jsonb_array_length(acc) <> jsonb_array_length(list) THEN
                outcome := 'FAILED';
                problem := 'MapError: zip of ' || jsonb_array_length(acc) || ' and ' || jsonb_array_length(list)
                           || ' items (' || (arg->>'kwarg') || '): zipped arguments need equal lengths';
                EXIT;
            END IF;
            acc := (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                      'k', a.x->'k',
                                      'kw', (a.x->'kw') || jsonb_build_object(arg->>'kwarg', l.x->'v'))
                                  ORDER BY a.o), '[]'::jsonb)
                    FROM jsonb_array_elements(acc) WITH ORDINALITY AS a(x, o)
                    JOIN jsonb_array_elements(list) WITH ORDINALITY AS l(x, o) ON l.o = a.o);
        END IF;
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
            decides_run = (outcome = 'FAILED'),
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
-- with the same slice. Returns how many children it made READY.

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
BEGIN
    SELECT t.* INTO h FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
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
        map_failed, map_skipped)
    SELECT p_run, p_key || '[' || (x->>'k') || ']', h.task_name, h.args,
           CASE WHEN p_item_of IS NULL THEN (h.kwargs::jsonb || (x->'kw'))::json ELSE h.kwargs END,
           CASE WHEN o <= cap THEN 'READY' ELSE 'PENDING' END, 1, h.max_attempts, h.backoff, 'all_success',
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
           true, p_key, (p_offset + o - 1)::int, x->>'k',
           CASE WHEN p_item_of IS NULL THEN NULL ELSE p_item_of || '[' || (x->>'k') || ']' END, 0, 0, 0, 0, 0
    FROM jsonb_array_elements(p_items) WITH ORDINALITY AS a(x, o);
    readied := LEAST(cap, n);
    IF readied > 0 THEN
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        SELECT p_run, p_key || '[' || (x->>'k') || ']', 1, 'PENDING', 'READY', p_actor, p_by,
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
-- checks on each child that finishes), the next window is inserted the same way (items by
-- index from map_items: no walk of the whole list). Returns how many children it made READY.

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
    slice := (SELECT jsonb_agg(h.map_items -> i ORDER BY i) FROM generate_series(h.map_next, h.map_next + w - 1) AS i);
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

-- orc_settle_v2: a task became terminal; count it into its children and decide them.
--
-- Adds the finished task to each child's counters (one UPDATE ... RETURNING per child, by
-- primary key: never a scan of the run), decides the child's trigger rule (orc_decide_v2),
-- moves decided children PENDING -> READY / SKIPPED / UPSTREAM_FAILED with their ledger rows
-- (a verdict reached before every parent is done says "early verdict"), expands a mapped child
-- whose rule says READY (orc_expand_v1) instead, and cascades the terminal ones the same way.
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
            FOREACH kid IN ARRAY kids LOOP
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
                          t.min_success_ratio, t.map_spec IS NOT NULL AS mapped INTO r;
                CONTINUE WHEN NOT FOUND OR r.state <> 'PENDING';
                verdict := orc_decide_v2(r.trigger_rule, r.n_upstream, r.n_done, r.n_succeeded, r.n_failed,
                                         r.n_upstream_failed, r.n_skipped, r.n_setup, r.n_setup_ok,
                                         r.n_setup_skipped, r.min_success_ratio);
                CONTINUE WHEN verdict IS NULL;
                why := 'upstream ' || q_keys[i] || ' ' || q_states[i]
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

-- orc_claim_v2: a worker's claim, QUEUED -> RUNNING for p_attempt, with the lease.
--
-- The attempt is the fencing token and the message's task name must be the node's. Returns
-- {"claimed": true, "args", "kwargs", "wants_upstream", "upstream"} (upstream: the results of
-- the parents that succeeded, for tasks that want them; a mapped parent's is the list of its
-- children's results in map order, those that succeeded; a child of a map has its map's
-- parents) or {"claimed": false, "conflict"} with the rejected event written (nothing is
-- written for an unknown task). A child of a map mapped item by item gets its item, the result
-- of the same key's child of the map before it, as its mapped keyword.

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
    UPDATE orc_tasks t SET state = 'RUNNING', started_at = now(), heartbeat_at = now(),
                           lease_expires_at = now() + make_interval(secs => p_lease), worker = p_worker
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'QUEUED' AND t.attempt = p_attempt
      AND t.task_name = p_task
    RETURNING t.args, t.kwargs, t.wants_upstream, t.map_parent, t.map_item_from INTO row;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'RUNNING', 'worker',
                                  'claim by ' || p_worker || ' for a message of ' || p_task);
        RETURN json_build_object('claimed', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'QUEUED', 'RUNNING', 'worker', NULL, 'claim by ' || p_worker, true, now());
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
    RETURN json_build_object('claimed', true, 'args', row.args, 'kwargs', kwargs,
                             'wants_upstream', row.wants_upstream, 'upstream', coalesce(upstream, '{}'::json));
END
$$;

-- orc_succeed_v2: RUNNING -> SUCCEEDED for p_attempt with the result, settled and admitted.
--
-- One statement, so one round trip in autocommit: the result checked (orc_result_problem_v1),
-- the compare-and-set and its ledger row, a branch's or short circuit's skips
-- (orc_follow_v1), the settlement (orc_settle_v2), then what to publish (orc_dispatch_v1).
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
    kids json;
    who text;
    flow text;
    feeds boolean;
    conflict text;
    problem text;
    readied int := 0;
BEGIN
    SELECT t.flow, t.feeds_map INTO flow, feeds FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    IF flow IS NOT NULL OR feeds THEN
        problem := orc_result_problem_v1(p_run, p_key, p_result);
        IF problem IS NOT NULL THEN
            RETURN json_build_object('accepted', false, 'invalid', problem);
        END IF;
    END IF;
    UPDATE orc_tasks t SET state = 'SUCCEEDED', result = p_result, finished_at = now(), lease_expires_at = NULL
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'RUNNING' AND t.attempt = p_attempt
    RETURNING t.children, t.worker INTO kids, who;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'SUCCEEDED', 'worker', NULL);
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'SUCCEEDED', 'worker', NULL, NULL, true, now());
    IF flow IS NOT NULL THEN
        readied := orc_follow_v1(p_run, p_key, flow, kids, p_result, 'worker', NULL);
    END IF;
    readied := readied + orc_settle_v2(p_run, p_key, 'SUCCEEDED', kids, 'worker', NULL);
    RETURN json_build_object('accepted', true,
                             'dispatches', orc_dispatch_v1(readied, who, p_window, p_worker_ttl, p_depth, p_aging));
END
$$;

-- orc_result_problem_v1: why a result cannot be its node's, or NULL. A branch's result must be
-- the key of a direct child or a list of them; a parent that a map maps over must return a
-- JSON list or object of at most the map's max_length items.

CREATE OR REPLACE FUNCTION orc_result_problem_v1(p_run text, p_key text, p_result json)
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    t record;
    d record;
    kids text[];
    bad text;
    n int;
BEGIN
    SELECT x.flow, x.children, x.feeds_map INTO t FROM orc_tasks x WHERE x.run_id = p_run AND x.key = p_key;
    kids := ARRAY(SELECT json_array_elements_text(coalesce(t.children, '[]'::json)));
    IF t.flow = 'branch' THEN
        IF json_typeof(p_result) = 'string' THEN
            bad := CASE WHEN NOT (p_result #>> '{}') = ANY (kids) THEN p_result #>> '{}' END;
        ELSIF json_typeof(p_result) = 'array' THEN
            IF EXISTS (SELECT 1 FROM json_array_elements(p_result) e WHERE json_typeof(e) <> 'string') THEN
                RETURN 'BranchError: a branch returns a child key or a list of child keys, not a list holding '
                       || (SELECT json_typeof(e) FROM json_array_elements(p_result) e
                           WHERE json_typeof(e) <> 'string' LIMIT 1) || 's';
            END IF;
            bad := (SELECT e FROM json_array_elements_text(p_result) e WHERE NOT e = ANY (kids) LIMIT 1);
        ELSE
            RETURN 'BranchError: a branch returns a child key or a list of child keys, not a '
                   || coalesce(json_typeof(p_result), 'null');
        END IF;
        IF bad IS NOT NULL THEN
            RETURN 'BranchError: ' || to_json(bad)::text || ' is not a direct child of ' || p_key
                   || ' (its children: ' || array_to_string(kids, ', ') || ')';
        END IF;
    END IF;
    IF t.feeds_map THEN
        FOR d IN SELECT c.key, c.map_spec FROM orc_tasks c
                 WHERE c.run_id = p_run AND c.key = ANY (kids) AND c.map_spec IS NOT NULL
                   AND c.map_spec->>'per_item' IS NULL
                   AND EXISTS (SELECT 1 FROM json_array_elements(c.map_spec->'args') a WHERE a->>'from' = p_key)
                 ORDER BY c.key LOOP
            IF coalesce(json_typeof(p_result), 'null') NOT IN ('array', 'object') THEN
                RETURN 'MapError: ' || d.key || ' maps over the result of ' || p_key
                       || ', which must be a JSON list or object, not a ' || coalesce(json_typeof(p_result), 'null');
            END IF;
            n := CASE WHEN json_typeof(p_result) = 'array' THEN json_array_length(p_result)
                      ELSE (SELECT count(*) FROM json_object_keys(p_result)) END;
            IF n > (d.map_spec->>'max_length')::int THEN
                RETURN 'MapError: ' || d.key || ' maps over ' || n || ' items of ' || p_key
                       || ', over its max_map_length ' || (d.map_spec->>'max_length');
            END IF;
        END LOOP;
    END IF;
    RETURN NULL;
END
$$;

-- orc_follow_v1: what a branch or a short circuit that just succeeded leaves out.
--
-- A branch (p_flow 'branch') follows the children its result names: each other direct child
-- that is still PENDING and is not reachable from a followed one is SKIPPED (reason
-- branch_not_taken) and settled, so its own children follow their trigger rules. A short
-- circuit ('short_circuit') whose result is falsy (null, false, 0, "", [], {}) skips every
-- PENDING task downstream of it (reason short_circuit), whatever their trigger rules. Called
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

-- orc_dispatch_v1: what a worker's outcome publishes. When it made nothing READY and the worker
-- (p_worker, "<worker name>:<pid>" as its claim recorded it) is live, its slot is passed on
-- (orc_pass_slot_v1); otherwise the whole admission runs (orc_admit_v1).

CREATE OR REPLACE FUNCTION orc_dispatch_v1(p_readied integer, p_worker text, p_window integer,
    p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    dispatches json;
    group_queues text;
BEGIN
    IF p_readied = 0 THEN
        SELECT w.queues::text INTO group_queues FROM orc_workers w
        WHERE w.name = regexp_replace(p_worker, ':[0-9]+$', '')
          AND w.seen_at > now() - make_interval(secs => p_worker_ttl);
        IF FOUND THEN
            SELECT coalesce(json_agg(d), '[]'::json) INTO dispatches
            FROM orc_pass_slot_v1(group_queues, p_worker_ttl, p_depth, p_aging) d;
            RETURN dispatches;
        END IF;
    END IF;
    SELECT coalesce(json_agg(d ORDER BY d.priority_rank, d.ready_at), '[]'::json) INTO dispatches
    FROM orc_admit_v1(p_window, p_worker_ttl, p_depth, true, p_aging) d;
    RETURN dispatches;
END
$$;

-- orc_skip_v1: a task body raised orchestrator.Skip: RUNNING -> SKIPPED for p_attempt.
--
-- The compare-and-set (fenced by the attempt like a success) with its ledger row ("user: " and
-- the reason), the settlement (orc_settle_v2: the children follow their trigger rules), then
-- what to publish (orc_dispatch_v1). Returns {"accepted": true, "dispatches": [...]} or
-- {"accepted": false, "conflict"}.

CREATE OR REPLACE FUNCTION orc_skip_v1(p_run text, p_key text, p_attempt integer, p_reason text, p_window integer,
    p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    kids json;
    who text;
    conflict text;
    readied int;
BEGIN
    UPDATE orc_tasks t SET state = 'SKIPPED', finished_at = now(), lease_expires_at = NULL, skip_reason = 'user'
    WHERE t.run_id = p_run AND t.key = p_key AND coalesce(t.state, '') = 'RUNNING' AND t.attempt = p_attempt
    RETURNING t.children, t.worker INTO kids, who;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'SKIPPED', 'worker', 'skip: ' || left(p_reason, 500));
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'SKIPPED', 'worker', NULL, 'user: ' || left(p_reason, 1000), true,
            now());
    readied := orc_settle_v2(p_run, p_key, 'SKIPPED', kids, 'worker', NULL);
    RETURN json_build_object('accepted', true,
                             'dispatches', orc_dispatch_v1(readied, who, p_window, p_worker_ttl, p_depth, p_aging));
END
$$;

-- The names earlier releases call, for their workers still running during a rolling upgrade:
-- each is a shim over the function that now does the work. The _v1 functions that 0011 replaced
-- (orc_claim_v1, orc_succeed_v1, orc_settle_v1; orc_decide_v1 is dropped: only settlement
-- called it) keep their signatures; the unversioned names of migrations 0004 to 0006 are the
-- four that the release before the versioned functions called from Python. Drop them when no
-- such worker is left (a later migration).

CREATE OR REPLACE FUNCTION orc_claim_v1(p_run text, p_key text, p_attempt integer, p_worker text,
    p_lease double precision, p_task text)
 RETURNS json
 LANGUAGE sql
AS $$
SELECT orc_claim_v2(p_run, p_key, p_attempt, p_worker, p_lease, p_task)
$$;

CREATE OR REPLACE FUNCTION orc_succeed_v1(p_run text, p_key text, p_attempt integer, p_result json,
    p_window integer, p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE sql
AS $$
-- that release knows no "invalid" answer (a branch's or a map parent's result its node cannot
-- use): it gets it as a conflict, and the attempt is recovered when its lease runs out
SELECT CASE WHEN r->>'invalid' IS NULL THEN r
            ELSE json_build_object('accepted', false, 'conflict', r->>'invalid') END
FROM orc_succeed_v2(p_run, p_key, p_attempt, p_result, p_window, p_worker_ttl, p_depth, p_aging) AS r
$$;

CREATE OR REPLACE FUNCTION orc_settle_v1(p_run text, p_key text, p_state text, p_children json, p_actor text,
    p_by text)
 RETURNS integer
 LANGUAGE sql
AS $$
SELECT orc_settle_v2(p_run, p_key, p_state, p_children, p_actor, p_by)
$$;

CREATE OR REPLACE FUNCTION orc_claim(p_run text, p_key text, p_attempt integer, p_worker text,
    p_lease double precision, p_task text)
 RETURNS json
 LANGUAGE sql
AS $$
SELECT orc_claim_v1(p_run, p_key, p_attempt, p_worker, p_lease, p_task)
$$;

CREATE OR REPLACE FUNCTION orc_succeed(p_run text, p_key text, p_attempt integer, p_result json, p_window integer,
    p_worker_ttl double precision, p_depth integer, p_aging double precision)
 RETURNS json
 LANGUAGE sql
AS $$
SELECT orc_succeed_v1(p_run, p_key, p_attempt, p_result, p_window, p_worker_ttl, p_depth, p_aging)
$$;

CREATE OR REPLACE FUNCTION orc_settle(p_run text, p_key text, p_state text, p_children json, p_actor text, p_by text)
 RETURNS integer
 LANGUAGE sql
AS $$
SELECT orc_settle_v1(p_run, p_key, p_state, p_children, p_actor, p_by)
$$;

CREATE OR REPLACE FUNCTION orc_admit(p_window integer, p_worker_ttl double precision, p_depth integer,
    p_wait boolean, p_aging double precision)
 RETURNS TABLE(run_id text, key text, attempt integer, task_name text, args json, kwargs json, queue text,
               soft_time_limit double precision, time_limit double precision, priority_rank integer,
               ready_at timestamp with time zone)
 LANGUAGE sql
AS $$
SELECT * FROM orc_admit_v1(p_window, p_worker_ttl, p_depth, p_wait, p_aging)
$$;
"""
