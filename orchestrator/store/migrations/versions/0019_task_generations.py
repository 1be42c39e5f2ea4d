"""A map expanded again never reuses a Celery task id: each new child's first attempt continues
after the highest attempt its key held in the run.

A map cleared with the task it maps over loses its children (each kept in the ledger with a
"removed" row) and is expanded again when that task succeeds again. Its new children started at
attempt 1, so their messages carried the task ids ``<run>.<key>.<attempt>`` of the attempts the
clear had just revoked: workers dropped them, the reconciler re-published them forever, and an old
message still in flight could claim the new row. ``orc_map_insert_v1`` changed in place: a node
expanded again (its attempt > 1) starts each child at 1 + the highest attempt the ledger holds for
the child's key (one set-based look-up in the expanding transaction), with ``max_attempts`` moved
by as much; a first expansion is unchanged. No DDL.

Revision ID: 0019
Revises: 0018
"""

import importlib
import re

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(SQL)


def downgrade() -> None:
    # orc_map_insert_v1 as 0018 installed it
    text = importlib.import_module("orchestrator.store.migrations.versions.0018_circuit_breakers").SQL
    found = re.search(r"-- orc_map_insert_v1:.*?\n\$\$;\n", text, re.S)
    assert found is not None, "0018 defines orc_map_insert_v1"
    op.execute(found.group(0))


#: orc_map_insert_v1 of store/sql/expand.sql as this revision installs it (frozen: a later change
#: is a later migration)
SQL = r"""
-- orc_map_insert_v1: the rows of one expansion (orc_expand_v1's) or of one more window of it
-- (orc_map_window_v1's). p_items is the slice [{"k", "kw"}] that starts at map index p_offset of
-- p_total items; p_item_of, for a node mapped item by item, is the map whose child of the same
-- key holds each item (its result is passed at claim time). The first slice (p_offset 0) also
-- moves the node PENDING -> MAPPED with its total, widens its downstream's counters and grows
-- the run's task counts by p_total. Recurses into the nodes mapped item by item over this one,
-- with the same slice. Each child uses its node's resources (their circuit breakers). A node
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
        map_failed, map_skipped, resources)
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
           true, p_key, (p_offset + o - 1)::int, x->>'k',
           CASE WHEN p_item_of IS NULL THEN NULL ELSE p_item_of || '[' || (x->>'k') || ']' END, 0, 0, 0, 0, 0,
           h.resources
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
"""
