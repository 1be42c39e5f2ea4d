"""Waits and events: a WAITING task state held as a row (``orc_tasks.wait_spec`` .. ``wait_resume``,
two partial indexes: the waits on an event by tenant and key, the waits due by instant), events
and signals (``orc_events``, one per tenant and event id), event triggers (``orc_triggers``,
``orc_trigger_firings``, a run's ``trigger``). The functions of ``wait.sql`` (``orc_wait_v1``,
``orc_wake_v1``, ``orc_emit_v1``, ``orc_wake_due_v1``, ``orc_defer_v1`` and their helpers);
``orc_settle_v2`` and ``orc_redecide_v2`` begin a wait node's wait where they made a task READY,
``orc_claim_v2`` tells a sensor and a body called again after it deferred what they need, and
``orc_clear_v2`` / ``orc_mark_v2`` drop a wait in progress. Those four change in place: what they
do for every task an earlier release can make is unchanged (only the nodes of this release wait).

Revision ID: 0015
Revises: 0014
"""

import importlib

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)

NEW_SIGNATURES = (
    "orc_wait_v1(text, text, text, text, text)",
    "orc_event_lock_v1(text, text)",
    "orc_wait_text_v1(text, text, jsonb, timestamp with time zone, timestamp with time zone)",
    "orc_wait_until_v1(jsonb, timestamp with time zone)",
    "orc_wake_v1(text, text, integer, text, jsonb, text, text, text)",
    "orc_emit_v1(text, text, jsonb, text, text, text)",
    "orc_wake_due_v1(integer, text)",
    "orc_defer_v1(text, text, integer, jsonb, text)",
)


def upgrade() -> None:
    op.add_column("orc_tasks", sa.Column("wait_spec", sa.JSON, nullable=True))
    op.add_column("orc_tasks", sa.Column("waiting", postgresql.JSONB, nullable=True))
    op.add_column("orc_tasks", sa.Column("wait_event", sa.String(200), nullable=True))
    op.add_column("orc_tasks", sa.Column("wait_match", postgresql.JSONB, nullable=True))
    op.add_column("orc_tasks", sa.Column("wake_at", TS, nullable=True))
    op.add_column("orc_tasks", sa.Column("wait_resume", sa.JSON, nullable=True))
    op.create_index(
        "ix_orc_tasks_waiting_event", "orc_tasks", ["tenant", "wait_event"],
        postgresql_where=sa.text("state = 'WAITING' AND wait_event IS NOT NULL"),
    )  # fmt: skip
    op.create_index(
        "ix_orc_tasks_wake_due", "orc_tasks", ["wake_at"],
        postgresql_where=sa.text("state = 'WAITING' AND wake_at IS NOT NULL"),
    )  # fmt: skip
    op.create_table(
        "orc_events",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("key", sa.String(200), nullable=False),
        sa.Column("event_id", sa.String(200), nullable=False),
        sa.Column("payload", postgresql.JSONB, nullable=False),
        sa.Column("run_id", sa.String(32), nullable=True),
        sa.Column("emitted_at", TS, nullable=False),
        sa.Column("by", sa.String(255), nullable=True),
        sa.Column("woke", sa.Integer, nullable=False, server_default="0"),
        sa.UniqueConstraint("tenant", "event_id", name="uq_orc_events_event_id"),
    )
    op.create_index("ix_orc_events_key", "orc_events", ["tenant", "key", "emitted_at"])
    op.create_index("ix_orc_events_emitted", "orc_events", ["emitted_at"])
    op.add_column("orc_runs", sa.Column("trigger", sa.String(200), nullable=True))
    op.create_index("ix_orc_runs_trigger_state", "orc_runs", ["tenant", "trigger", "state"])
    op.create_table(
        "orc_triggers",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("event_key", sa.String(200), nullable=False),
        sa.Column("match", postgresql.JSONB, nullable=True),
        sa.Column("spec", sa.JSON, nullable=True),
        sa.Column("spec_hash", sa.String(64), nullable=True),
        sa.Column("factory", sa.String(255), nullable=True),
        sa.Column("registered", sa.String(200), nullable=True),
        sa.Column("registered_version", sa.Integer, nullable=True),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("max_active_runs", sa.Integer, nullable=True),
        sa.Column("paused", sa.Boolean, nullable=False),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("last_error_at", TS, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
    )
    op.create_index("ix_orc_triggers_event", "orc_triggers", ["tenant", "event_key"])
    op.create_table(
        "orc_trigger_firings",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("trigger", sa.String(200), primary_key=True),
        sa.Column("event", sa.BigInteger, primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("dag_version", sa.Integer, nullable=True),
        sa.Column("at", TS, nullable=False),
    )
    op.create_index(
        "ix_orc_trigger_firings_open", "orc_trigger_firings", ["state", "at"],
        postgresql_where=sa.text("state IN ('pending', 'waiting')"),
    )  # fmt: skip
    op.execute(SQL)


def downgrade() -> None:
    # the earlier bodies of the four functions changed in place, then this revision's go
    op.execute(importlib.import_module("orchestrator.store.migrations.versions.0011_dynamic_dags").SQL)
    op.execute(importlib.import_module("orchestrator.store.migrations.versions.0014_short_circuit_on_clear").SQL)
    for signature in NEW_SIGNATURES:
        op.execute(f"DROP FUNCTION IF EXISTS {signature}")
    op.drop_index("ix_orc_trigger_firings_open", table_name="orc_trigger_firings")
    op.drop_table("orc_trigger_firings")
    op.drop_index("ix_orc_triggers_event", table_name="orc_triggers")
    op.drop_table("orc_triggers")
    op.drop_index("ix_orc_runs_trigger_state", table_name="orc_runs")
    op.drop_column("orc_runs", "trigger")
    op.drop_index("ix_orc_events_emitted", table_name="orc_events")
    op.drop_index("ix_orc_events_key", table_name="orc_events")
    op.drop_table("orc_events")
    op.drop_index("ix_orc_tasks_wake_due", table_name="orc_tasks")
    op.drop_index("ix_orc_tasks_waiting_event", table_name="orc_tasks")
    for column in ("wait_resume", "wake_at", "wait_match", "wait_event", "waiting", "wait_spec"):
        op.drop_column("orc_tasks", column)


#: store/sql/settle.sql, claim.sql, clear.sql and wait.sql as this revision installs them (frozen:
#: a later change is a later migration; the other files are as earlier revisions installed them)
SQL = r"""
-- orc_settle_v2: a task became terminal; count it into its children and decide them.
--
-- Adds the finished task to each child's counters (one UPDATE ... RETURNING per child, by
-- primary key: never a scan of the run), decides the child's trigger rule (orc_decide_v2),
-- moves decided children PENDING -> READY / SKIPPED / UPSTREAM_FAILED with their ledger rows
-- (a verdict reached before every parent is done says "early verdict"), expands a mapped child
-- whose rule says READY (orc_expand_v1) and begins a wait node's wait (orc_wait_v1) instead,
-- and cascades the terminal ones the same way.
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
                          t.min_success_ratio, t.map_spec IS NOT NULL AS mapped, t.flow = 'wait' AS waits INTO r;
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

-- orc_claim_v2: a worker's claim, QUEUED -> RUNNING for p_attempt, with the lease.
--
-- The attempt is the fencing token and the message's task name must be the node's. Returns
-- {"claimed": true, "args", "kwargs", "wants_upstream", "upstream"} (upstream: the results of
-- the parents that succeeded, for tasks that want them; a mapped parent's is the list of its
-- children's results in map order, those that succeeded; a child of a map has its map's
-- parents) or {"claimed": false, "conflict"} with the rejected event written (nothing is
-- written for an unknown task). A child of a map mapped item by item gets its item, the result
-- of the same key's child of the map before it, as its mapped keyword. A sensor's claim adds
-- "sensor" (its polling spec), a deferred body's called again "resumed" (orc_wake_v1).

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
    RETURNING t.args, t.kwargs, t.wants_upstream, t.map_parent, t.map_item_from, t.wait_spec, t.wait_resume INTO row;
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
    IF row.wait_spec IS NOT NULL OR row.wait_resume IS NOT NULL THEN
        -- a sensor's polling, and what a body called again after it deferred gets
        RETURN json_build_object('claimed', true, 'args', row.args, 'kwargs', kwargs,
                                 'wants_upstream', row.wants_upstream, 'upstream', coalesce(upstream, '{}'::json),
                                 'sensor', row.wait_spec, 'resumed', row.wait_resume);
    END IF;
    RETURN json_build_object('claimed', true, 'args', row.args, 'kwargs', kwargs,
                             'wants_upstream', row.wants_upstream, 'upstream', coalesce(upstream, '{}'::json));
END
$$;

-- orc_clear_v2: an operator's clear: the tasks p_keys go back to be run again.
--
-- Under the run's row lock, each task of p_keys (the caller has resolved --downstream /
-- --upstream / --only-failed into the list) moves to PENDING with attempt + 1, whatever it held:
-- a QUEUED or RUNNING attempt is fenced by the new attempt (its claim, its heartbeat and its
-- outcome are refused and recorded), and an outcome it had stays in its ledger row (the event's
-- result). Maps: a map cleared with the parent it maps over is expanded again when that parent
-- succeeds again (its children removed now, each with a "removed" ledger row, never counted
-- again; the maps chained on it too); a map cleared without it stays MAPPED and runs again the
-- children in p_keys (the caller lists them: all, or the failed ones); a map child cleared on its
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
            WHERE t.run_id = p_run AND t.key = ANY (keys) AND t.map_spec IS NOT NULL AND EXISTS (
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
-- run; n_upstream too, a map expanded or not), the run's
-- open tasks recounted and a final run reopened (RUNNING, with its event) when it has tasks to
-- run again or its outcome changed, then each PENDING
-- task of p_keys and their children is decided by its rule (orc_decide_v2; a root or an
-- "always" is READY; a child that a branch not cleared did not follow is SKIPPED again,
-- branch_not_taken; a task below a short circuit not cleared that returned a falsy result is
-- SKIPPED again, short_circuit, whatever its rule, as orc_follow_v1 skipped it), a terminal
-- verdict settled (orc_settle_v2 cascades it and closes the run when nothing is left open).
-- v2: v1 knew no short circuit (a task cleared below one ran).

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
    UPDATE orc_runs u SET open_tasks = (
        SELECT count(*) FROM orc_tasks t WHERE t.run_id = p_run
          AND t.state NOT IN ('SUCCEEDED', 'FAILED', 'UPSTREAM_FAILED', 'SKIPPED', 'CANCELLED'))
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
            WHERE p.flow = 'short_circuit' AND p.state = 'SUCCEEDED' AND p.result IS NOT NULL
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

-- orc_wait_v1: a wait node whose rule says READY begins to wait (PENDING -> WAITING).
--
-- The node's wait_spec says what for: {"kind": "event", "event", "match"} (an event of its
-- tenant, or a signal to its run, whose payload contains match), {"kind": "sleep"} with "until"
-- (an instant), "at" + "tz" (the next such wall time in that zone) or "delay" (seconds), or
-- {"kind": "approval"} (orchestrator approve | reject); any of them with "timeout" (seconds) and
-- "on_timeout" ("fail" or "skip"). The instant and the deadline are absolute, fixed now. An
-- event wait first takes the key's lock (orc_event_lock_v1; an emit of that key takes it too: a
-- wait that begins while its event commits sees it) and looks back "lookback" seconds for a
-- matching event: found, the node SUCCEEDS at once with the payload; a sleep already past
-- succeeds at once with null.
-- Returns {"state": "WAITING"} or {"state": "SUCCEEDED", "children"} (the caller settles it), or
-- NULL when the task is no longer PENDING.

CREATE OR REPLACE FUNCTION orc_wait_v1(p_run text, p_key text, p_actor text, p_by text, p_reason text)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    r record;
    spec jsonb;
    kind text;
    until timestamptz;
    deadline timestamptz;
    found_payload jsonb;
    why text;
BEGIN
    SELECT t.tenant, t.attempt, t.children, t.wait_spec::jsonb AS spec INTO r
    FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key AND t.state = 'PENDING' FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    spec := r.spec;
    kind := spec->>'kind';
    until := orc_wait_until_v1(spec, now());
    deadline := CASE WHEN spec ? 'timeout' THEN now() + make_interval(secs => (spec->>'timeout')::float8) END;
    IF kind = 'event' THEN
        PERFORM orc_event_lock_v1(r.tenant, spec->>'event');
        SELECT e.payload INTO found_payload FROM orc_events e
        WHERE e.tenant = r.tenant AND e.key = spec->>'event' AND (e.run_id IS NULL OR e.run_id = p_run)
          AND e.payload @> coalesce(spec->'match', '{}'::jsonb)
          AND e.emitted_at >= now() - make_interval(secs => coalesce((spec->>'lookback')::float8, 0))
        ORDER BY e.id DESC LIMIT 1;
        IF FOUND THEN
            why := 'event ' || (spec->>'event') || ' had come (lookback)';
        END IF;
    ELSIF kind = 'sleep' AND until <= now() THEN
        why := 'sleep until ' || until || ': already past';
    END IF;
    IF why IS NOT NULL THEN
        UPDATE orc_tasks t SET state = 'SUCCEEDED', result = found_payload::json, finished_at = now()
        WHERE t.run_id = p_run AND t.key = p_key;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, p_key, r.attempt, 'PENDING', 'SUCCEEDED', p_actor, p_by, why, true, now());
        RETURN json_build_object('state', 'SUCCEEDED', 'children', r.children);
    END IF;
    UPDATE orc_tasks t SET state = 'WAITING', ready_at = coalesce(t.ready_at, now()),
        waiting = jsonb_build_object('kind', kind, 'event', spec->'event', 'match', spec->'match',
                                     'until', until, 'deadline', deadline,
                                     'on_timeout', coalesce(spec->>'on_timeout', 'fail'), 'since', now()),
        wait_event = CASE WHEN kind = 'event' THEN spec->>'event' END,
        wait_match = CASE WHEN kind = 'event' THEN spec->'match' END,
        wake_at = CASE WHEN until IS NULL THEN deadline WHEN deadline IS NULL THEN until
                       ELSE least(until, deadline) END
    WHERE t.run_id = p_run AND t.key = p_key;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, r.attempt, 'PENDING', 'WAITING', p_actor, p_by,
            p_reason || '; waits for ' || orc_wait_text_v1(kind, spec->>'event', spec->'match', until, deadline),
            true, now());
    RETURN json_build_object('state', 'WAITING');
END
$$;

-- orc_event_lock_v1: the lock an emit of an event key and a wait that begins on it take, held
-- to the end of the transaction, so that either the emit sees the wait or the wait sees the
-- event. Keys share 256 locks (a two-key advisory lock in its own class: never the admission's):
-- a transaction that begins waits on thousands of keys (a submit, a settlement) holds at most
-- 256 locks, within the server's shared lock table; two keys of a bucket only serialise.

CREATE OR REPLACE FUNCTION orc_event_lock_v1(p_tenant text, p_key text)
 RETURNS void
 LANGUAGE sql
AS $$
    SELECT pg_advisory_xact_lock(1869768553, (hashtextextended(p_tenant || '/' || p_key, 0) & 255)::integer)
$$;

-- orc_wait_text_v1: what a wait waits for, as the ledger and explain say it.

CREATE OR REPLACE FUNCTION orc_wait_text_v1(p_kind text, p_event text, p_match jsonb, p_until timestamptz,
    p_deadline timestamptz)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE
AS $$
    SELECT CASE p_kind
               WHEN 'event' THEN 'event ' || p_event || coalesce(' matching ' || p_match::text, '')
               WHEN 'approval' THEN 'an approval (orchestrator approve | reject)'
               WHEN 'sensor' THEN 'its next check'
               WHEN 'defer' THEN coalesce('event ' || p_event || coalesce(' matching ' || p_match::text, ''),
                                          'its time')
               ELSE 'its time' END
           || coalesce(' until ' || p_until::text, '')
           || coalesce(' (deadline ' || p_deadline::text || ')', '')
$$;

-- orc_wait_until_v1: the instant a wait's spec names, from p_base: "until" (an instant), "at"
-- (a wall time such as 09:30 or 09:30:15) in "tz" (the next one after p_base), or "delay" seconds after p_base;
-- NULL when it names none.

CREATE OR REPLACE FUNCTION orc_wait_until_v1(p_spec jsonb, p_base timestamptz)
 RETURNS timestamptz
 LANGUAGE plpgsql
 STABLE
AS $$
DECLARE
    local_now timestamp;
    cand timestamp;
    zone text := coalesce(p_spec->>'tz', 'UTC');
BEGIN
    IF p_spec ? 'until' THEN
        RETURN (p_spec->>'until')::timestamptz;
    ELSIF p_spec ? 'at' THEN
        local_now := p_base AT TIME ZONE zone;
        cand := date_trunc('day', local_now) + (p_spec->>'at')::time;
        IF cand <= local_now THEN
            cand := cand + interval '1 day';
        END IF;
        RETURN cand AT TIME ZONE zone;
    ELSIF p_spec ? 'delay' THEN
        RETURN p_base + make_interval(secs => (p_spec->>'delay')::float8);
    END IF;
    RETURN NULL;
END
$$;

-- orc_wake_v1: end the wait of p_key's attempt p_attempt (WAITING, under its row lock).
--
-- p_how: 'event' (its event came: p_payload), 'due' (its instant passed), 'timeout' (its
-- deadline passed), 'approve' / 'reject' (a person's answer: p_payload names them). A wait node
-- SUCCEEDS with the payload (an event's, an approval's; a sleep's null); a deferred body or a
-- sensor goes back to READY to be called again, with attempt + 1 and one more attempt allowed
-- (its retry budget untouched) and wait_resume = {"event", "state", "timed_out": false, "deadline"}. A
-- timeout ends any of them FAILED with "WaitTimeout: ..." (or SKIPPED, reason wait_timeout, with
-- on_timeout "skip"); a rejection FAILED. A terminal outcome is settled (orc_settle_v2). Returns
-- how many tasks it made READY, or -1 when the task was not waiting at that attempt (nothing
-- written but the rejected event).

CREATE OR REPLACE FUNCTION orc_wake_v1(p_run text, p_key text, p_attempt integer, p_how text, p_payload jsonb,
    p_actor text, p_by text, p_reason text)
 RETURNS integer
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    r record;
    kind text;
    outcome text;
    err text;
    v_result json;
BEGIN
    SELECT t.attempt, t.children, t.waiting INTO r FROM orc_tasks t
    WHERE t.run_id = p_run AND t.key = p_key AND t.state = 'WAITING' AND t.attempt = p_attempt FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM orc_reject_v1(p_run, p_key, p_attempt,
            CASE WHEN p_how IN ('timeout', 'reject') THEN 'FAILED' ELSE 'SUCCEEDED' END, p_actor, p_reason);
        RETURN -1;
    END IF;
    kind := r.waiting->>'kind';
    IF p_how = 'timeout' THEN
        outcome := CASE WHEN r.waiting->>'on_timeout' = 'skip' THEN 'SKIPPED' ELSE 'FAILED' END;
        err := 'WaitTimeout: waited for ' || orc_wait_text_v1(kind, r.waiting->>'event', r.waiting->'match', NULL, NULL)
               || ' until its deadline ' || (r.waiting->>'deadline');
    ELSIF p_how = 'reject' THEN
        outcome := 'FAILED';
        err := 'Rejected: ' || coalesce(p_reason, 'rejected');
    ELSIF kind IN ('defer', 'sensor') THEN
        UPDATE orc_tasks t SET state = 'READY', attempt = t.attempt + 1, max_attempts = t.max_attempts + 1,
            ready_at = now(), wait_event = NULL, wait_match = NULL, wake_at = NULL, waiting = NULL,
            wait_resume = json_build_object('event', p_payload, 'state', r.waiting->'state', 'timed_out', false,
                                            'deadline', r.waiting->'deadline')
        WHERE t.run_id = p_run AND t.key = p_key;
        INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
        VALUES (p_run, p_key, p_attempt + 1, 'WAITING', 'READY', p_actor, p_by, p_reason, true, now());
        RETURN 1;
    ELSE
        outcome := 'SUCCEEDED';
        v_result := CASE WHEN kind = 'sleep' THEN NULL ELSE p_payload::json END;
    END IF;
    UPDATE orc_tasks t SET state = outcome, finished_at = now(), result = v_result,
        error = err, skip_reason = CASE WHEN outcome = 'SKIPPED' THEN 'wait_timeout' ELSE t.skip_reason END,
        wait_event = NULL, wait_match = NULL, wake_at = NULL
    WHERE t.run_id = p_run AND t.key = p_key;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'WAITING', outcome, p_actor, p_by, coalesce(err, p_reason), true, now());
    RETURN orc_settle_v2(p_run, p_key, outcome, r.children, p_actor, p_by);
END
$$;

-- orc_emit_v1: an event of p_tenant (or, with p_run, a signal to that run): written once per
-- (tenant, event id) under its key's lock, then every task of the tenant WAITING for that key
-- (a signal: of that run) whose match its payload contains is woken (orc_wake_v1), in this
-- transaction. Returns {"id", "duplicate": false, "woken", "readied"}, or {"id", "duplicate":
-- true} for an event id seen before (nothing woken again).

CREATE OR REPLACE FUNCTION orc_emit_v1(p_tenant text, p_key text, p_payload jsonb, p_event_id text, p_run text,
    p_by text)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    eid bigint;
    w record;
    woken int := 0;
    readied int := 0;
    n int;
BEGIN
    PERFORM orc_event_lock_v1(p_tenant, p_key);
    INSERT INTO orc_events (tenant, key, event_id, payload, run_id, emitted_at, by)
    VALUES (p_tenant, p_key, p_event_id, p_payload, p_run, now(), p_by)
    ON CONFLICT (tenant, event_id) DO NOTHING
    RETURNING id INTO eid;
    IF eid IS NULL THEN
        SELECT e.id INTO eid FROM orc_events e WHERE e.tenant = p_tenant AND e.event_id = p_event_id;
        RETURN json_build_object('id', eid, 'duplicate', true, 'woken', 0, 'readied', 0);
    END IF;
    FOR w IN SELECT t.run_id, t.key, t.attempt FROM orc_tasks t
             WHERE t.state = 'WAITING' AND t.tenant = p_tenant AND t.wait_event = p_key
               AND (p_run IS NULL OR t.run_id = p_run)
               AND (t.wait_match IS NULL OR p_payload @> t.wait_match)
             ORDER BY t.run_id, t.key LOOP
        n := orc_wake_v1(w.run_id, w.key, w.attempt, 'event', p_payload, 'event', p_by,
                         CASE WHEN p_run IS NULL THEN 'event ' ELSE 'signal ' END || p_key
                         || ' (' || p_event_id || ')');
        IF n >= 0 THEN
            woken := woken + 1;
            readied := readied + n;
        END IF;
    END LOOP;
    UPDATE orc_events SET woke = woken WHERE id = eid AND woken > 0;
    RETURN json_build_object('id', eid, 'duplicate', false, 'woken', woken, 'readied', readied);
END
$$;

-- orc_wake_due_v1: the reconciler's pass over waits whose instant or deadline has passed (the
-- partial index ix_orc_tasks_wake_due, oldest first, at most p_limit, rows other passes hold
-- skipped): a wait whose instant came first is due (a sleep ends, a deferred body or a sensor is
-- called again), else it timed out. Returns {"woken", "readied"}.

CREATE OR REPLACE FUNCTION orc_wake_due_v1(p_limit integer, p_actor text)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    w record;
    until timestamptz;
    deadline timestamptz;
    how text;
    woken int := 0;
    readied int := 0;
    n int;
BEGIN
    FOR w IN SELECT t.run_id, t.key, t.attempt, t.waiting FROM orc_tasks t
             WHERE t.state = 'WAITING' AND t.wake_at IS NOT NULL AND t.wake_at <= now()
             ORDER BY t.wake_at LIMIT p_limit FOR UPDATE SKIP LOCKED LOOP
        until := (w.waiting->>'until')::timestamptz;
        deadline := (w.waiting->>'deadline')::timestamptz;
        how := CASE WHEN until IS NOT NULL AND until <= now() AND (deadline IS NULL OR until <= deadline)
                    THEN 'due' ELSE 'timeout' END;
        n := orc_wake_v1(w.run_id, w.key, w.attempt, how, NULL, p_actor, NULL,
                         CASE how WHEN 'due' THEN 'its time came (' || until || ')'
                                  ELSE 'its deadline passed (' || deadline || ')' END);
        IF n >= 0 THEN
            woken := woken + 1;
            readied := readied + n;
        END IF;
    END LOOP;
    RETURN json_build_object('woken', woken, 'readied', readied);
END
$$;

-- orc_defer_v1: a running body that raised orchestrator.Defer, or a sensor whose check said "not
-- yet", gives its slot back: RUNNING -> WAITING for p_attempt (its lease dropped), with
-- p_spec {"kind": "defer" | "sensor", "until" (an instant) | "delay" (seconds), "event",
-- "match", "timeout" (seconds from now) | "deadline" (an instant), "on_timeout", "state", "lookback"}.
-- An event defer looks back for its event like orc_wait_v1: found, the task is READY again at
-- once. Returns {"accepted": true, "readied"} or {"accepted": false, "conflict"} (the rejected
-- event written).

CREATE OR REPLACE FUNCTION orc_defer_v1(p_run text, p_key text, p_attempt integer, p_spec jsonb, p_actor text)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    r record;
    conflict text;
    kind text := coalesce(p_spec->>'kind', 'defer');
    until timestamptz;
    deadline timestamptz;
    found_payload jsonb;
BEGIN
    until := orc_wait_until_v1(p_spec, now());
    deadline := CASE WHEN p_spec ? 'deadline' THEN (p_spec->>'deadline')::timestamptz
                     WHEN p_spec ? 'timeout' THEN now() + make_interval(secs => (p_spec->>'timeout')::float8) END;
    UPDATE orc_tasks t SET state = 'WAITING', lease_expires_at = NULL, heartbeat_at = NULL, worker = NULL,
        waiting = jsonb_build_object('kind', kind, 'event', p_spec->'event', 'match', p_spec->'match',
                                     'until', until, 'deadline', deadline,
                                     'on_timeout', coalesce(p_spec->>'on_timeout', 'fail'), 'since', now(),
                                     'state', p_spec->'state'),
        wait_event = p_spec->>'event', wait_match = p_spec->'match',
        wake_at = CASE WHEN until IS NULL THEN deadline WHEN deadline IS NULL THEN until
                       ELSE least(until, deadline) END,
        wait_resume = NULL
    WHERE t.run_id = p_run AND t.key = p_key AND t.state = 'RUNNING' AND t.attempt = p_attempt
    RETURNING t.tenant INTO r;
    IF NOT FOUND THEN
        conflict := orc_reject_v1(p_run, p_key, p_attempt, 'WAITING', p_actor, 'defer');
        RETURN json_build_object('accepted', false, 'conflict', coalesce(conflict, 'no such task'));
    END IF;
    INSERT INTO orc_task_events (run_id, key, attempt, from_state, to_state, actor, by, reason, accepted, at)
    VALUES (p_run, p_key, p_attempt, 'RUNNING', 'WAITING', p_actor, NULL,
            CASE kind WHEN 'sensor' THEN 'its check said not yet' ELSE 'deferred' END || '; waits for '
            || orc_wait_text_v1(kind, p_spec->>'event', p_spec->'match', until, deadline), true, now());
    IF p_spec ? 'event' THEN
        PERFORM orc_event_lock_v1(r.tenant, p_spec->>'event');
        SELECT e.payload INTO found_payload FROM orc_events e
        WHERE e.tenant = r.tenant AND e.key = p_spec->>'event' AND (e.run_id IS NULL OR e.run_id = p_run)
          AND e.payload @> coalesce(p_spec->'match', '{}'::jsonb)
          AND e.emitted_at >= now() - make_interval(secs => coalesce((p_spec->>'lookback')::float8, 0))
        ORDER BY e.id DESC LIMIT 1;
        IF FOUND THEN
            RETURN json_build_object('accepted', true, 'readied',
                orc_wake_v1(p_run, p_key, p_attempt, 'event', found_payload, p_actor, NULL,
                            'event ' || (p_spec->>'event') || ' had come (lookback)'));
        END IF;
    END IF;
    RETURN json_build_object('accepted', true, 'readied', 0);
END
$$;
"""
