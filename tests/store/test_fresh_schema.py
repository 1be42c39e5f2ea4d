"""A database created fresh (``migrate.create``: the current schema in one step, stamped at
head) is the database that replaying every migration from 0001 makes: the same tables, columns
(type, nullability, default), indexes, constraints, sequences, triggers, server functions (text,
arguments, result, settings) and seeded rows, at the same revision. The replayed chain is the
truth (existing installs were made by it); the fresh path is what ``orchestrator db upgrade``
does on an empty database. Column order is not compared: a fresh table has the declared
order, an upgraded one the order its migrations added the columns; no SQL of ours reads columns
by position."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.engine import Connection, Engine

from orchestrator.store import make_engine, migrate

pytestmark = pytest.mark.postgres

#: what the comparison reads, each a query over the catalog of the ``public`` schema
CATALOG: dict[str, str] = {
    "tables": """
        SELECT c.relname, c.relkind::text, c.relpersistence::text FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
        ORDER BY 1""",
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               coalesce(pg_get_expr(d.adbin, d.adrelid), ''), a.attidentity::text, a.attgenerated::text,
               coalesce(a.attcollation::regcollation::text, '')
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p') AND a.attnum > 0
          AND NOT a.attisdropped
        ORDER BY 1, 2""",
    "indexes": """
        SELECT i.indexname, i.tablename, i.indexdef FROM pg_indexes i WHERE i.schemaname = 'public' ORDER BY 1""",
    "constraints": """
        SELECT t.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid), k.condeferrable, k.convalidated
        FROM pg_constraint k JOIN pg_class t ON t.oid = k.conrelid
        WHERE k.connamespace = 'public'::regnamespace ORDER BY 1, 2""",
    "sequences": """
        SELECT s.sequencename, s.data_type::text, s.start_value, s.increment_by, s.max_value, s.cycle
        FROM pg_sequences s WHERE s.schemaname = 'public' ORDER BY 1""",
    "triggers": """
        SELECT t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = 'public'::regnamespace AND NOT t.tgisinternal ORDER BY 1""",
    "types": """
        SELECT t.typname, t.typtype::text FROM pg_type t
        WHERE t.typnamespace = 'public'::regnamespace AND t.typtype NOT IN ('c', 'b') ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_function_result(p.oid),
               l.lanname, p.prokind::text, p.provolatile::text, p.proisstrict, p.prosecdef, p.proparallel::text,
               coalesce(array_to_string(p.proconfig, ','), ''), p.prosrc,
               coalesce(obj_description(p.oid, 'pg_proc'), '')
        FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
        WHERE p.pronamespace = 'public'::regnamespace ORDER BY 1, 2""",
    "revision": "SELECT version_num FROM alembic_version",
}


def describe(conn: Connection) -> dict[str, Any]:
    """The schema of the connected database as plain rows, plus each table's row count and the
    names of its secrets (their values are random)."""
    found: dict[str, Any] = {name: [tuple(r) for r in conn.exec_driver_sql(q)] for name, q in CATALOG.items()}
    tables = [name for name, kind, _ in found["tables"] if kind in ("r", "p") and name != "alembic_version"]
    found["rows"] = [(t, conn.exec_driver_sql(f'SELECT count(*) FROM "{t}"').scalar_one()) for t in tables]
    found["secrets"] = sorted(r[0] for r in conn.exec_driver_sql("SELECT name FROM orc_secrets"))
    return found


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two :func:`describe` results, one line per row found on one side only."""
    out: list[str] = []
    for part in sorted(set(a) | set(b)):
        left, right = a.get(part, []), b.get(part, [])
        out += [f"{part}: only in the first: {row}" for row in left if row not in right]
        out += [f"{part}: only in the second: {row}" for row in right if row not in left]
    return out


def _database(name: str) -> Engine:
    from tests.conftest import ensure_database, test_database

    return make_engine(ensure_database(test_database(name)))


_replayed: list[str] = []


def replayed_url() -> str:
    """A database made by replaying every migration from 0001 on an empty schema (once per session)."""
    if not _replayed:
        engine = _database("orchestrator_test_replayed")
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql("DROP SCHEMA public CASCADE")
                conn.exec_driver_sql("CREATE SCHEMA public")
            migrate.upgrade(engine, replay=True)
            _replayed.append(engine.url.render_as_string(hide_password=False))
        finally:
            engine.dispose()
    return _replayed[0]


@pytest.fixture(scope="module")
def fresh() -> str:
    """A database created by ``migrate.upgrade`` on an empty schema: the fresh path."""
    engine = _database("orchestrator_test_fresh")
    try:
        created: list[bool] = []
        real = migrate.create

        def spy(conn: Connection) -> None:
            created.append(True)
            real(conn)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(migrate, "create", spy)
            migrate.reset(engine)
        assert created == [True], "an empty database was not created from the current schema"
        return engine.url.render_as_string(hide_password=False)
    finally:
        engine.dispose()


def _describe(url: str) -> dict[str, Any]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return describe(conn)
    finally:
        engine.dispose()


def test_a_fresh_database_is_the_replayed_one(fresh: str) -> None:
    created, replayed = _describe(fresh), _describe(replayed_url())
    assert created["revision"] == replayed["revision"] == [(migrate.head(),)]
    assert len(created["functions"]) >= 40 and len(created["columns"]) >= 200, "the catalog queries found too little"
    found = differences(replayed, created)
    assert not found, "fresh (second) differs from replayed (first):\n" + "\n".join(found)


def test_the_comparison_sees_a_small_difference(fresh: str) -> None:
    """The comparer itself: one default, one function setting and one index changed inside a
    transaction that is rolled back are each reported."""
    engine = make_engine(fresh)
    try:
        with engine.connect() as conn:
            before = describe(conn)
            conn.exec_driver_sql("ALTER TABLE orc_pools ALTER COLUMN description SET DEFAULT 'x'")
            conn.exec_driver_sql("ALTER FUNCTION orc_decide_v2 SET work_mem = '8MB'")
            conn.exec_driver_sql("CREATE INDEX ix_orc_pools_extra ON orc_pools (slots)")
            after = describe(conn)
            conn.rollback()
            assert describe(conn) == before
    finally:
        engine.dispose()
    found = differences(before, after)
    assert any(line.startswith("columns:") and "'x'" in line for line in found), found
    assert any(line.startswith("functions:") and "work_mem=8MB" in line for line in found), found
    assert any(line.startswith("indexes:") and "ix_orc_pools_extra" in line for line in found), found


def test_a_database_with_a_revision_is_migrated_not_created() -> None:
    """The same entry point upgrades an existing database revision by revision."""
    engine = _database("orchestrator_test_fresh_upgrade")
    try:
        migrate.reset(engine)
        migrate.downgrade(engine, "0022")
        with engine.connect() as conn:
            assert not migrate.is_empty(conn)
        migrate.upgrade(engine)
        assert migrate.current(engine) == migrate.head()
    finally:
        engine.dispose()
