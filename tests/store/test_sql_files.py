"""The server functions have one home: ``orchestrator/store/sql/``. A database made by replaying
every migration holds exactly the files' definitions (so a change to a file without its migration
fails here; a fresh database installs the files themselves), every migration after
:data:`DELTAS_FROM` installs exactly the functions it changes, and the calls a worker of the
previous release makes still work against the new schema."""

from __future__ import annotations

import re
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from psycopg.types.json import Json

from orchestrator import DAG
from orchestrator.core.routing import default_queues, route
from orchestrator.store import Store
from orchestrator.store.functions import FILES, definitions, source
from tests.conftest import empty_tables
from tests.store.test_fresh_schema import replayed_url

pytestmark = pytest.mark.postgres

SCRATCH = "orc_sql_files_check"

#: what a function is, as Postgres keeps it: body, arguments, result, language, settings
FUNCTIONS = sa.text(
    """
    SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS args, pg_get_function_result(p.oid) AS result,
           l.lanname, p.provolatile, coalesce(array_to_string(p.proconfig, ','), '') AS config, p.prosrc
    FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace JOIN pg_language l ON l.oid = p.prolang
    WHERE n.nspname = :schema AND p.proname LIKE 'orc\\_%'
    ORDER BY 1, 2
    """
)


def test_a_migrated_database_holds_exactly_the_files() -> None:
    engine = sa.create_engine(replayed_url().replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as conn:
            migrated = [tuple(r) for r in conn.execute(FUNCTIONS, {"schema": "public"})]
            # the files, installed in a scratch schema inside a transaction that is rolled back
            conn.exec_driver_sql(f"CREATE SCHEMA {SCRATCH}")
            conn.exec_driver_sql(f"SET LOCAL search_path TO {SCRATCH}, public")
            conn.exec_driver_sql(definitions())
            from_files = [tuple(r) for r in conn.execute(FUNCTIONS, {"schema": SCRATCH})]
            conn.rollback()
    finally:
        engine.dispose()
    assert len(from_files) >= len(FILES)
    names = lambda rows: [(r[0], r[1]) for r in rows]  # noqa: E731
    assert names(migrated) == names(from_files), "functions in the database that no file defines, or the reverse"
    for got, want in zip(migrated, from_files, strict=True):
        assert got == want, f"{got[0]}({got[1]}) differs from its file: a change to store/sql needs a migration"


#: the first revision of the rule "a migration carries only what it changes" (0017 and 0018, before
#: it, restated functions they did not change; they stay as they are: installs depend on them)
DELTAS_FROM = "0019"
CREATES = re.compile(r"CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+(\w+)\s*\(", re.I)


def test_each_migration_installs_only_the_functions_it_changes() -> None:
    """Replayed one revision at a time from the one before :data:`DELTAS_FROM`: the functions a
    revision's file creates are exactly those whose definition it adds or changes, and it never
    reads ``store/sql`` (the files move on; a migration is frozen)."""
    from alembic.script import ScriptDirectory

    from orchestrator.store import make_engine, migrate
    from tests.conftest import ensure_database, test_database

    chain = list(reversed(list(ScriptDirectory.from_config(migrate._config()).walk_revisions())))
    first = next(i for i, s in enumerate(chain) if s.revision == DELTAS_FROM)
    engine = make_engine(ensure_database(test_database("orchestrator_test_deltas")))
    try:
        migrate.reset(engine)
        migrate.downgrade(engine, chain[first - 1].revision)

        def functions() -> dict[tuple[str, str], tuple[object, ...]]:
            with engine.connect() as conn:
                return {(r[0], r[1]): tuple(r[2:]) for r in conn.execute(FUNCTIONS, {"schema": "public"})}

        before = functions()
        for script in chain[first:]:
            migrate.upgrade(engine, script.revision, replay=True)
            after = functions()
            changed = {name for (name, args), row in after.items() if before.get((name, args)) != row}
            assert script.path is not None
            text = open(script.path).read()
            assert "definitions()" not in text and "store.functions" not in text, script.revision
            created = set(CREATES.findall(text))
            assert created == changed, (
                f"{script.revision} restates {sorted(created - changed)} unchanged,"
                f" or changes {sorted(changed - created)} without its own copy"
            )
            before = after
    finally:
        engine.dispose()


def test_each_file_defines_its_own_versioned_function() -> None:
    for name in FILES:
        text = source(name)
        if name == "legacy":
            continue
        assert re.search(rf"CREATE OR REPLACE FUNCTION orc_{name}_v[0-9]+\(", text), name
        assert re.match(rf"-- orc_{name}_v[0-9]+:", text.lstrip()), f"{name}.sql starts with what the function does"


#: the statements the previous release (migration 0008) sent, word for word
OLD_CLAIM = "SELECT orc_claim(%s::text, %s::text, %s::int, %s::text, %s::float8, %s::text)"
OLD_SUCCEED = "SELECT orc_succeed(%s::text, %s::text, %s::int, %s::json, %s::int, %s::float8, %s::int, %s::float8)"
OLD_ADMIT = "SELECT * FROM orc_admit(%s, %s, %s, %s, %s)"
OLD_SETTLE = "SELECT orc_settle(%s, %s, %s, %s::json, %s, %s)"
#: and those of the release before 0011 (the versioned _v1 functions)
V1_CLAIM = "SELECT orc_claim_v1(%s::text, %s::text, %s::int, %s::text, %s::float8, %s::text)"
V1_SUCCEED = "SELECT orc_succeed_v1(%s::text, %s::text, %s::int, %s::json, %s::int, %s::float8, %s::int, %s::float8)"
V1_SETTLE = "SELECT orc_settle_v1(%s, %s, %s, %s::json, %s, %s)"


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    st = Store(pg_url)
    empty_tables(st.engine)
    st.workers.register("old-worker", default_queues(), 10)
    yield st
    st.attempts.hot.close()
    st.dispose()


def test_an_old_workers_calls_work_against_the_new_schema(store: Store) -> None:
    dag = DAG("rolling")
    dag.task("a", "t")
    dag.task("b", "t", upstream=["a"])
    dag.task("c", "t")
    dag.task("d", "t", upstream=["c"])
    queues = {k: route("default", dag.priority) for k in dag.nodes}
    run_id, _ = store.submission.create_run(dag, queues=queues, wants_upstream=lambda _: True)
    dsn = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as old:
        admitted = old.execute(OLD_ADMIT, (10, 30.0, 2, True, 300.0)).fetchall()
        assert {r[1] for r in admitted} == {"a", "c"}
        claim = old.execute(OLD_CLAIM, (run_id, "a", 1, "old-worker:1", 30.0, "t")).fetchone()
        assert claim is not None and claim[0]["claimed"] is True
        done = old.execute(OLD_SUCCEED, (run_id, "a", 1, Json({"rows": 3}), 10, 30.0, 2, 300.0)).fetchone()
        assert done is not None and done[0]["accepted"] is True
        assert [d["key"] for d in done[0]["dispatches"]] == ["b"]
        # the old release failed a task from Python, then settled it with orc_settle
        old.execute("UPDATE orc_tasks SET state = 'FAILED' WHERE run_id = %s AND key = 'c'", (run_id,))
        readied = old.execute(OLD_SETTLE, (run_id, "c", "FAILED", '["d"]', "worker", None)).fetchone()
        assert readied == (0,)
        again = old.execute(OLD_SUCCEED, (run_id, "a", 1, Json(None), 10, 30.0, 2, 300.0)).fetchone()
        assert again is not None and again[0]["accepted"] is False  # fenced, as before
    assert store.reads.get_task(run_id, "b").state.value == "QUEUED"
    assert store.reads.get_task(run_id, "d").state.value == "UPSTREAM_FAILED"
    assert store.reads.get_task(run_id, "a").result == {"rows": 3}


def test_the_previous_releases_v1_calls_work_against_the_new_schema(store: Store) -> None:
    dag = DAG("rolling-v1")
    dag.task("a", "t")
    dag.task("b", "t", upstream=["a"])
    dag.task("c", "t")
    dag.task("d", "t", upstream=["c"])
    queues = {k: route("default", dag.priority) for k in dag.nodes}
    run_id, _ = store.submission.create_run(dag, queues=queues, wants_upstream=lambda _: True)
    dsn = store.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as old:
        admitted = old.execute(OLD_ADMIT, (10, 30.0, 2, True, 300.0)).fetchall()
        assert {r[1] for r in admitted} == {"a", "c"}
        claim = old.execute(V1_CLAIM, (run_id, "a", 1, "old-worker:1", 30.0, "t")).fetchone()
        assert claim is not None and claim[0]["claimed"] is True
        done = old.execute(V1_SUCCEED, (run_id, "a", 1, Json([1, 2]), 10, 30.0, 2, 300.0)).fetchone()
        assert done is not None and done[0]["accepted"] is True
        assert [d["key"] for d in done[0]["dispatches"]] == ["b"]
        old.execute("UPDATE orc_tasks SET state = 'FAILED' WHERE run_id = %s AND key = 'c'", (run_id,))
        assert old.execute(V1_SETTLE, (run_id, "c", "FAILED", '["d"]', "worker", None)).fetchone() == (0,)
    assert store.reads.get_task(run_id, "d").state.value == "UPSTREAM_FAILED"
    assert store.reads.get_task(run_id, "a").result == [1, 2]
