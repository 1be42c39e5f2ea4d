-- orc_breaker_v1: a finished attempt of a task that uses p_resources, counted by their breakers.
--
-- Called in the transaction of the attempt's outcome, after its admission (orc_succeed_v2 for a
-- success, the failure path for a failure with the exception's class names p_exc_types). A
-- success is a call; a failure is counted only when it is the resource's: a time-out, a
-- connection error, or a class the breaker names in failure_on (any other failure tells nothing
-- about the resource). Calls go to per-second buckets (orc_breaker_counts); a counted failure
-- checks the trip rule over the last window_seconds (calls >= min_calls, failures >=
-- min_failures, failures / calls >= failure_rate) and opens the breaker. The outcome of a probe
-- (orc_breaker_probes) closes a half-open breaker (the ramp's first wave next) or opens it again
-- for twice as long (up to open_max). A success in the ramp's wave counts toward the next wave.
-- Every change of a breaker's row is made under the admission lock, taken before the buckets
-- (a plain success in a closed breaker takes no lock but its bucket's row). A breaker in
-- mode 'metrics' counts and never changes state; 'disabled' counts nothing.

CREATE OR REPLACE FUNCTION orc_breaker_v1(p_resources text[], p_run text, p_key text, p_attempt integer,
    p_failed boolean, p_exc_types text[], p_actor text)
 RETURNS void
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    b record;
    counted boolean;
    probe boolean;
    calls bigint;
    fails bigint;
    locked boolean := false;
BEGIN
    -- the admission lock before any bucket's row, for every breaker at once (a lock taken between
    -- two buckets could wait for a transaction that waits for the first bucket)
    IF EXISTS (SELECT 1 FROM orc_breakers k WHERE k.name = ANY (p_resources) AND k.mode = 'on'
               AND (p_failed OR k.state <> 'closed' OR k.wave IS NOT NULL)) THEN
        PERFORM pg_advisory_xact_lock(1869767425);
        locked := true;
    END IF;
    FOR b IN SELECT * FROM orc_breakers k WHERE k.name = ANY (p_resources) AND k.mode <> 'disabled' ORDER BY k.name
    LOOP
        counted := NOT p_failed OR coalesce(p_exc_types && ARRAY['TimeoutError', 'SoftTimeLimitExceeded',
            'TimeLimitExceeded', 'ConnectionError', 'OSError', 'socket.timeout', 'WaitTimeout']
            OR p_exc_types && b.failure_on, false);
        IF NOT locked AND b.mode = 'on' AND (b.state <> 'closed' OR b.wave IS NOT NULL) THEN
            -- it changed state since the look above (rare): lock now, and read it again
            PERFORM pg_advisory_xact_lock(1869767425);
            locked := true;
            SELECT * INTO b FROM orc_breakers k WHERE k.name = b.name;
        END IF;
        IF counted THEN
            INSERT INTO orc_breaker_counts AS c (name, second, calls, failures)
            VALUES (b.name, date_trunc('second', now()), 1, CASE WHEN p_failed THEN 1 ELSE 0 END)
            ON CONFLICT (name, second) DO UPDATE SET calls = c.calls + 1, failures = c.failures + excluded.failures;
        END IF;
        CONTINUE WHEN b.mode <> 'on';
        DELETE FROM orc_breaker_probes p
        WHERE p.name = b.name AND p.run_id = p_run AND p.key = p_key AND p.attempt = p_attempt;
        probe := FOUND;
        IF probe AND b.state = 'half_open' THEN
            IF NOT counted THEN
                -- a failure that is not the resource's: the permit goes to another probe
                UPDATE orc_breakers k SET probes_left = k.probes_left + 1, updated_at = now() WHERE k.name = b.name;
            ELSIF p_failed THEN
                PERFORM orc_breaker_reopen_v1(b.name, p_actor,
                    'probe ' || p_run || '/' || p_key || ' #' || p_attempt || ' failed: '
                    || coalesce(p_exc_types[1], 'error'));
            ELSE
                PERFORM orc_breaker_move_v1(b.name, 'closed', p_actor, NULL,
                    'probe ' || p_run || '/' || p_key || ' #' || p_attempt || ' succeeded');
                UPDATE orc_breakers k SET wave = CASE WHEN k.ramp_max > 1 THEN 1 END, wave_admitted = 0,
                    wave_done = 0, wave_at = now(), reopens = 0, open_for = NULL
                WHERE k.name = b.name;
            END IF;
        ELSIF b.state = 'closed' AND counted THEN
            IF p_failed THEN
                SELECT coalesce(sum(c.calls), 0), coalesce(sum(c.failures), 0) INTO calls, fails
                FROM orc_breaker_counts c
                WHERE c.name = b.name AND c.second > now() - make_interval(secs => b.window_seconds);
                IF calls >= b.min_calls AND fails >= b.min_failures AND fails >= b.failure_rate * calls THEN
                    UPDATE orc_breakers k SET open_for = k.open_min, reopens = 0 WHERE k.name = b.name;
                    PERFORM orc_breaker_move_v1(b.name, 'open', p_actor, NULL,
                        fails || ' of ' || calls || ' calls failed in ' || b.window_seconds || 's (last: '
                        || coalesce(p_exc_types[1], 'error') || ')');
                ELSIF b.wave IS NOT NULL THEN
                    -- a failure in the ramp: it starts again from one task
                    UPDATE orc_breakers k SET wave = 1, wave_admitted = 0, wave_done = 0, wave_at = now(),
                        updated_at = now()
                    WHERE k.name = b.name;
                END IF;
            ELSIF b.wave IS NOT NULL THEN
                IF b.wave_done + 1 >= b.wave AND b.wave_admitted >= b.wave THEN
                    -- the wave succeeded: the next one is twice as large, the ramp ends past ramp_max
                    UPDATE orc_breakers k SET wave = CASE WHEN k.wave * 2 <= k.ramp_max THEN k.wave * 2 END,
                        wave_admitted = 0, wave_done = 0, wave_at = now(), updated_at = now()
                    WHERE k.name = b.name;
                ELSE
                    UPDATE orc_breakers k SET wave_done = k.wave_done + 1 WHERE k.name = b.name;
                END IF;
            END IF;
        END IF;
    END LOOP;
END
$$;

-- orc_breaker_move_v1: a breaker's state change and its ledger row (orc_breaker_events): to
-- 'open' (until now() + open_for; forced by an operator: until closed), 'half_open' (probes
-- permits), 'closed'. The caller holds the admission lock.

CREATE OR REPLACE FUNCTION orc_breaker_move_v1(p_name text, p_to text, p_actor text, p_by text, p_reason text)
 RETURNS void
 LANGUAGE plpgsql
AS $$
DECLARE
    was text;
BEGIN
    SELECT k.state INTO was FROM orc_breakers k WHERE k.name = p_name;
    UPDATE orc_breakers k
    SET state = p_to,
        open_until = CASE WHEN p_to = 'open' AND NOT k.forced THEN now() + make_interval(secs => k.open_for) END,
        probes_left = CASE WHEN p_to = 'half_open' THEN k.probes ELSE 0 END,
        wave = CASE WHEN p_to = 'closed' THEN k.wave END,
        forced = p_to = 'open' AND k.forced,
        changed_at = now(), updated_at = now()
    WHERE k.name = p_name;
    IF p_to <> 'half_open' THEN
        DELETE FROM orc_breaker_probes p WHERE p.name = p_name;
    END IF;
    INSERT INTO orc_breaker_events (name, from_state, to_state, actor, by, reason, at)
    VALUES (p_name, was, p_to, p_actor, p_by, p_reason, now());
END
$$;

-- orc_breaker_reopen_v1: a half-open breaker's probe failed (or outlived its lease): open again
-- for twice the last open_for, at most open_max. The caller holds the admission lock.

CREATE OR REPLACE FUNCTION orc_breaker_reopen_v1(p_name text, p_actor text, p_reason text)
 RETURNS void
 LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE orc_breakers k
    SET reopens = k.reopens + 1, open_for = least(k.open_max, coalesce(k.open_for, k.open_min / 2) * 2)
    WHERE k.name = p_name;
    PERFORM orc_breaker_move_v1(p_name, 'open', p_actor, NULL, p_reason);
END
$$;

-- orc_breaker_held_v1: which of p_resources' breakers holds a task back now, or NULL.
--
-- Open (until open_until, or forced), half-open with no probe permit left, or ramping with its
-- wave full. An open breaker whose open_until passed becomes half-open here (its ledger row
-- says the dispatcher moved it). The caller holds the admission lock.

CREATE OR REPLACE FUNCTION orc_breaker_held_v1(p_resources text[])
 RETURNS text
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    b record;
BEGIN
    FOR b IN SELECT * FROM orc_breakers k
             WHERE k.name = ANY (p_resources) AND k.mode = 'on' AND (k.state <> 'closed' OR k.wave IS NOT NULL)
             ORDER BY k.name
    LOOP
        IF b.state = 'open' THEN
            IF b.forced OR b.open_until > now() THEN
                RETURN b.name;
            END IF;
            PERFORM orc_breaker_move_v1(b.name, 'half_open', 'dispatcher', NULL,
                'open for ' || b.open_for || 's: ' || b.probes || ' probe(s)');
            CONTINUE WHEN b.probes > 0;
            RETURN b.name;
        ELSIF b.state = 'half_open' THEN
            CONTINUE WHEN b.probes_left > 0;
            RETURN b.name;
        ELSIF b.wave_admitted >= b.wave THEN
            RETURN b.name;
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- orc_breaker_admitted_v1: admission moved a task that uses p_resources to QUEUED: a half-open
-- breaker's probe permit becomes a lease on this attempt (probe_lease seconds), a ramping one's
-- wave counts it. The caller holds the admission lock.

CREATE OR REPLACE FUNCTION orc_breaker_admitted_v1(p_run text, p_key text, p_resources text[])
 RETURNS void
 LANGUAGE plpgsql
 SET plan_cache_mode TO 'force_generic_plan'
AS $$
DECLARE
    att int;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM orc_breakers k WHERE k.name = ANY (p_resources) AND k.mode = 'on'
                   AND (k.state = 'half_open' OR k.wave IS NOT NULL)) THEN
        RETURN;
    END IF;
    SELECT t.attempt INTO att FROM orc_tasks t WHERE t.run_id = p_run AND t.key = p_key;
    INSERT INTO orc_breaker_probes (name, run_id, key, attempt, lease_until)
    SELECT k.name, p_run, p_key, att, now() + make_interval(secs => k.probe_lease)
    FROM orc_breakers k WHERE k.name = ANY (p_resources) AND k.mode = 'on' AND k.state = 'half_open'
    ON CONFLICT DO NOTHING;
    UPDATE orc_breakers k
    SET probes_left = CASE WHEN k.state = 'half_open' THEN k.probes_left - 1 ELSE k.probes_left END,
        wave_admitted = CASE WHEN k.state = 'closed' AND k.wave IS NOT NULL THEN k.wave_admitted + 1
                             ELSE k.wave_admitted END,
        updated_at = now()
    WHERE k.name = ANY (p_resources) AND k.mode = 'on' AND (k.state = 'half_open' OR k.wave IS NOT NULL);
END
$$;

-- orc_breaker_tick_v1: the reconciler's pass over the breakers. A probe that outlived its lease
-- counts as a failure (the breaker opens again: no breaker stays half-open for a probe that never
-- returns); an open breaker whose time is up becomes half-open; a ramp's full wave that did not
-- come back within probe_lease is handed out again (a lost task does not stop the ramp); buckets
-- older than their window are deleted. Returns how many breakers changed state.

CREATE OR REPLACE FUNCTION orc_breaker_tick_v1()
 RETURNS integer
 LANGUAGE plpgsql
AS $$
DECLARE
    p record;
    b record;
    n int := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(1869767425);
    FOR p IN DELETE FROM orc_breaker_probes x WHERE x.lease_until < now() RETURNING x.* LOOP
        IF EXISTS (SELECT 1 FROM orc_breakers k WHERE k.name = p.name AND k.state = 'half_open' AND k.mode = 'on') THEN
            PERFORM orc_breaker_reopen_v1(p.name, 'reconciler',
                'probe ' || p.run_id || '/' || p.key || ' #' || p.attempt || ' outlived its lease');
            n := n + 1;
        END IF;
    END LOOP;
    FOR b IN SELECT k.name, k.open_for, k.probes FROM orc_breakers k
             WHERE k.mode = 'on' AND k.state = 'open' AND NOT k.forced AND k.open_until <= now() LOOP
        PERFORM orc_breaker_move_v1(b.name, 'half_open', 'reconciler', NULL,
            'open for ' || b.open_for || 's: ' || b.probes || ' probe(s)');
        n := n + 1;
    END LOOP;
    UPDATE orc_breakers k SET wave_admitted = 0, wave_done = 0, wave_at = now()
    WHERE k.wave IS NOT NULL AND k.wave_admitted >= k.wave AND k.wave_at < now() - make_interval(secs => k.probe_lease);
    DELETE FROM orc_breaker_counts c USING orc_breakers k
    WHERE c.name = k.name AND c.second < now() - make_interval(secs => k.window_seconds + 1);
    DELETE FROM orc_breaker_counts c WHERE NOT EXISTS (SELECT 1 FROM orc_breakers k WHERE k.name = c.name);
    RETURN n;
END
$$;
