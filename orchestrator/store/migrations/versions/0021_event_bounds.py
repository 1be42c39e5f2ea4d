"""Event locks per tenant, and an event id reused with another key, payload or run named.

``orc_event_lock_v1`` changed in place: a tenant's event keys share 256 advisory locks of their
own (the tenant is in the lock's key), so one tenant's submits and emits never wait on
another's (they shared 256 locks across every tenant). ``orc_emit_v1`` changed in place: a
duplicate event id's answer also says what differs from the first event (``conflict``: its key,
its run or its payload; null when nothing does), which the store refuses as
``EventIdConflict``; a caller of the previous release reads the same ``duplicate`` as before.

Revision ID: 0021
Revises: 0020
"""

import importlib
import re

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(SQL)


def downgrade() -> None:
    # both functions as migration 0015 installed them (no revision between changed them)
    text = importlib.import_module("orchestrator.store.migrations.versions.0015_waits_and_events").SQL
    for name in ("orc_event_lock_v1", "orc_emit_v1"):
        found = re.search(rf"-- {name}:.*?\n\$\$;\n", text, re.S)
        assert found is not None, name
        op.execute(found.group(0))


#: orc_event_lock_v1 and orc_emit_v1 of store/sql/wait.sql as this revision installs them
#: (frozen: a later change is a later migration)
SQL = r"""
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
"""
