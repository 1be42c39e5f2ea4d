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
-- event. A tenant's keys share 256 locks: a two-key advisory lock whose first key is the
-- tenant's (no other lock of ours has two keys; the admission's has one) and whose second is
-- the key's bucket. A transaction that begins waits on thousands of keys (a submit, a
-- settlement) holds at most 256 locks, within the server's shared lock table; two keys of a
-- bucket only serialise, and only within their tenant: another tenant's emit never waits on
-- them (two tenants share buckets only if their names' 32-bit hashes are equal).

CREATE OR REPLACE FUNCTION orc_event_lock_v1(p_tenant text, p_key text)
 RETURNS void
 LANGUAGE sql
AS $$
    SELECT pg_advisory_xact_lock(hashtext('orc-event:' || p_tenant), (hashtextextended(p_key, 0) & 255)::integer)
$$;

-- orc_wait_text_v1: what a wait waits for, as the ledger and explain say it (a child-run node,
-- kind child: its child run, started by the engine's child pass once the node waits).

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
               WHEN 'child' THEN 'its child run'
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
-- true} for an event id seen before (nothing woken again); when that id came with another key,
-- run or payload, also "conflict": "key", "run" or "payload", with the first one's "key" and
-- "run" (the caller refuses it: EventIdConflict).

CREATE OR REPLACE FUNCTION orc_emit_v1(p_tenant text, p_key text, p_payload jsonb, p_event_id text, p_run text,
    p_by text)
 RETURNS json
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    eid bigint;
    first_event record;
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
        SELECT e.id, e.key, e.run_id, CASE WHEN e.key IS DISTINCT FROM p_key THEN 'key'
                                           WHEN e.run_id IS DISTINCT FROM p_run THEN 'run'
                                           WHEN e.payload IS DISTINCT FROM p_payload THEN 'payload' END AS differs
        INTO first_event FROM orc_events e WHERE e.tenant = p_tenant AND e.event_id = p_event_id;
        RETURN json_build_object('id', first_event.id, 'duplicate', true, 'woken', 0, 'readied', 0,
                                 'conflict', first_event.differs, 'key', first_event.key, 'run', first_event.run_id);
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

-- orc_wake_due_v2: the reconciler's pass over waits whose instant or deadline has passed (the
-- partial index ix_orc_tasks_wake_due, oldest first, at most p_limit, rows other passes hold
-- skipped): a wait whose instant came first is due (a sleep ends, a deferred body or a sensor is
-- called again), else it timed out. Returns {"woken", "readied"}. With p_mine (the sharded
-- reconciler): only the waits of runs whose shard, the first 32 bits of md5(run id) mod
-- p_shards (store/shards.py's shard_of), is one of p_mine; NULL: every wait.

CREATE OR REPLACE FUNCTION orc_wake_due_v2(p_limit integer, p_actor text, p_shards integer, p_mine integer[])
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
               AND (p_mine IS NULL
                    OR mod(('x' || substr(md5(t.run_id), 1, 8))::bit(32)::bigint, p_shards)::int = ANY (p_mine))
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
