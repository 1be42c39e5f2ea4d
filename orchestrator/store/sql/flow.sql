-- orc_flow_v1: keyed flow control's read of a key (store/flow.py), under the key's lock.
--
-- Takes the key's advisory transaction lock (every decision about a key, a submit's or the
-- reconciler's release, is taken under it), then reads, with a snapshot taken after the lock
-- (a statement of its own: what a submit that held the lock committed is seen), the key's
-- RUNNING runs of the tenant other than p_exclude (open = true, oldest first) and, when p_since
-- is given, the key's runs admitted after it (open = false, newest first: the throttle's
-- window). One round trip for what a keyed submit reads.

CREATE OR REPLACE FUNCTION orc_flow_v1(p_tenant text, p_key text, p_exclude text, p_since timestamptz)
 RETURNS TABLE (
    open boolean, id text, held text, held_until timestamptz, flow_first_at timestamptz,
    created_at timestamptz, flow json, flow_admitted_at timestamptz
 )
 LANGUAGE plpgsql
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('orc_flow:' || p_tenant || '/' || p_key, 0));
    RETURN QUERY
    SELECT true, r.id::text, r.held::text, r.held_until, r.flow_first_at, r.created_at, r.flow, r.flow_admitted_at
    FROM orc_runs r
    WHERE r.tenant = p_tenant AND r.flow_key = p_key AND r.state = 'RUNNING'
      AND r.id IS DISTINCT FROM p_exclude
    ORDER BY r.created_at, r.id;
    IF p_since IS NOT NULL THEN
        RETURN QUERY
        SELECT false, r.id::text, r.held::text, r.held_until, r.flow_first_at, r.created_at, r.flow, r.flow_admitted_at
        FROM orc_runs r
        WHERE r.tenant = p_tenant AND r.flow_key = p_key AND r.flow_admitted_at > p_since
        ORDER BY r.flow_admitted_at DESC;
    END IF;
END;
$$;
