"""A wide map's next window without a pause: ``orc_map_window_v1`` changed in place.

It read the next window's items one by one from the header's stored list (``h.map_items -> i``
for each index): each read fetched the whole TOASTed list again, so a window of 10,000 out of
100,000 items took 16 s (990,000 buffer reads, measured with auto_explain on the bench's big map),
while the header's row lock held every completing child of the map. It now slices the window out
in one read (``jsonb_path_query_array(map_items, '$[from to to]')``: 75 ms for the same window).
Same signature and result; for every map the same children.

Revision ID: 0029
Revises: 0028
"""

import importlib
import re

from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(SQL)


def downgrade() -> None:
    # orc_map_window_v1 as 0018 installed it (no revision between changed it)
    text = importlib.import_module("orchestrator.store.migrations.versions.0018_circuit_breakers").SQL
    found = re.search(r"CREATE OR REPLACE FUNCTION orc_map_window_v1\(.*?\n\$\$;\n", text, re.S)
    assert found is not None, "0018 defines orc_map_window_v1"
    op.execute(found.group(0))


#: orc_map_window_v1 of store/sql/expand.sql as this revision installs it (frozen: a later change
#: is a later migration)
SQL = r"""
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
"""
