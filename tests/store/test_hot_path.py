"""The server functions of the hot path (``store/sql/``): a terminated session. (The trigger rules:
``test_trigger_rules.py``.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG
from orchestrator.core.routing import default_queues, route
from orchestrator.core.states import TaskState
from orchestrator.store import Store
from tests.conftest import empty_tables

pytestmark = pytest.mark.postgres
T = TaskState


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    st = Store(pg_url)
    empty_tables(st.engine)
    st.workers.register("w", default_queues(), 100)
    yield st
    st.attempts.hot.close()
    st.dispose()


def test_the_hot_path_survives_a_terminated_session(store: Store) -> None:
    dag = DAG("reconnect")
    dag.task("a", "t")
    dag.task("b", "t", upstream=["a"])
    run_id, _ = store.submission.create_run(
        dag, queues={k: route("default", dag.priority) for k in dag.nodes}, wants_upstream=lambda _: True
    )
    store.admission.admit_ready(10)
    assert store.attempts.claim(run_id, "a", 1, "w", 30, "t") is not None
    # the server drops the hot path's session (a Postgres restart, an admin's terminate)
    with store.engine.connect() as conn:
        conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid() AND query LIKE '%orc_claim%'"
            )
        )
    out = store.attempts.succeed(run_id, "a", 1, {"x": 1}, 10)
    assert out.accepted and [(d.key, d.attempt) for d in out.dispatches] == [("b", 1)]
    claim = store.attempts.claim(run_id, "b", 1, "w", 30, "t")
    assert claim is not None and claim.upstream_results == {"a": {"x": 1}}


def _fan_out(store: Store, n: int) -> str:
    dag = DAG("pass_slot")
    dag.task("root", "t")
    for i in range(n):
        dag.task(f"m{i}", "t", upstream=["root"])
    dag.task("sink", "t", upstream=[f"m{i}" for i in range(n)])
    run_id, _ = store.submission.create_run(
        dag, queues={k: route("default", dag.priority) for k in dag.nodes}, wants_upstream=lambda _: False
    )
    return run_id


def _in_flight(store: Store, run_id: str) -> int:
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT count(*) FROM orc_tasks WHERE run_id = :r AND state IN ('QUEUED', 'RUNNING')"),
                {"r": run_id},
            ).scalar_one()
        )


def test_a_completion_that_made_nothing_ready_passes_its_slot_on(store: Store) -> None:
    """A middle task of a fan-out frees one slot of its worker; the slots are handed to the next
    READY tasks in batches (no admission pass): once the group is down to one message per slot,
    the completion fills it to the window; a completion that made tasks READY admits up to the
    window; a completion by a worker that is not registered runs the whole admission."""
    store.workers.unregister("w")
    store.workers.register("g1", default_queues(), 2)  # window 2 * depth 2 = 4
    run_id = _fan_out(store, 20)
    assert [d.key for d in store.admission.admit_ready(100)] == ["root"]
    assert store.attempts.claim(run_id, "root", 1, "g1:7", 30, "t") is not None
    out = store.attempts.succeed(run_id, "root", 1, None, 100)
    assert len(out.dispatches) == 4 and _in_flight(store, run_id) == 4  # settlement made 20 READY
    first = out.dispatches[0].key
    assert store.attempts.claim(run_id, first, 1, "g1:7", 30, "t") is not None
    out = store.attempts.succeed(run_id, first, 1, None, 100)
    assert out.dispatches == [] and _in_flight(store, run_id) == 3  # still a message per slot and more
    second = next(k for k in (f"m{i}" for i in range(20)) if store.reads.get_task(run_id, k).state.value == "QUEUED")
    assert store.attempts.claim(run_id, second, 1, "g1:7", 30, "t") is not None
    out = store.attempts.succeed(run_id, second, 1, None, 100)
    assert len(out.dispatches) == 2 and _in_flight(store, run_id) == 4  # down to 2: both slots passed on
    with store.engine.connect() as conn:
        passed = conn.execute(
            sa.text(
                "SELECT actor, accepted FROM orc_task_events WHERE run_id = :r AND key = :k AND to_state = 'QUEUED'"
            ),
            {"r": run_id, "k": out.dispatches[0].key},
        ).all()
    assert [tuple(p) for p in passed] == [("dispatcher", True)]
    # the window shrinks (a worker went away): completions stop passing slots until it drains
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE orc_workers SET concurrency = 1 WHERE name = 'g1'"))  # window 2
    queued = [k for k in (f"m{i}" for i in range(20)) if store.reads.get_task(run_id, k).state.value == "QUEUED"]
    got = []
    for key in queued[:3]:
        assert store.attempts.claim(run_id, key, 1, "g1:7", 30, "t") is not None
        got.append(len(store.attempts.succeed(run_id, key, 1, None, 100).dispatches))
    assert got == [0, 0, 1]  # in flight 3, then 2 (at the window), then 1: one slot free again
    # an attempt whose worker is not registered: the whole admission fills the window
    key = queued[3]
    assert store.attempts.claim(run_id, key, 1, "ghost:1", 30, "t") is not None
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE orc_workers SET concurrency = 3 WHERE name = 'g1'"))  # window 6
    out = store.attempts.succeed(run_id, key, 1, None, 100)
    assert len(out.dispatches) == 5 and _in_flight(store, run_id) == 6  # 1 left in flight + 5


def _hot_sessions(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND pid <> pg_backend_pid() AND (query LIKE '%orc_claim_v2%' OR query LIKE '%orc_succeed_v2%')"
                )
            ).scalar_one()
        )


@pytest.mark.parametrize("pooler", [False, True], ids=["prepared", "transaction-pooler"])
def test_threads_share_the_hot_paths_few_connections(pg_url: str, pooler: bool) -> None:
    """16 threads claim and commit 64 tasks through a hot path of 2 connections (a thread waits
    for a free one); through a transaction pooler nothing is prepared on the server."""
    import threading

    st = Store(pg_url, pool_size=2, transaction_pooler=pooler)
    try:
        empty_tables(st.engine)
        st.workers.register("w", default_queues(), 100)
        run_id = _fan_out(st, 64)
        st.admission.admit_ready(10)
        assert st.attempts.claim(run_id, "root", 1, "w", 30, "t") is not None
        assert st.attempts.succeed(run_id, "root", 1, None, 1000).accepted
        keys = [f"m{i}" for i in range(64)]
        st.admission.admit_ready(1000)
        errors: list[BaseException] = []

        def work(mine: list[str]) -> None:
            try:
                for key in mine:
                    assert st.attempts.claim(run_id, key, 1, "w", 30, "t") is not None
                    assert st.attempts.succeed(run_id, key, 1, {"k": key}, 1000).accepted
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(keys[i::16],)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert {t.key: t.state for t in st.reads.get_tasks(run_id)}["sink"] in {T.READY, T.QUEUED}
        assert _hot_sessions(st) <= 2
        # statements prepared on the server: the hot path's unless through a pooler, and the
        # store's own (psycopg prepares a statement run five times) likewise
        conn_, slots = st.attempts.hot._checkout()
        try:
            hot_prepared = conn_.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
        finally:
            st.attempts.hot._checkin(conn_, slots, broken=False)
        assert hot_prepared is not None and (hot_prepared[0] > 0) is (not pooler)
        with st.engine.connect() as conn:
            for _ in range(8):
                conn.execute(sa.text("SELECT count(*) FROM orc_tasks WHERE run_id = :r"), {"r": run_id})
            prepared = conn.execute(sa.text("SELECT count(*) FROM pg_prepared_statements")).scalar_one()
        assert (prepared > 0) is (not pooler)
    finally:
        st.dispose()


def _estimated_rows(plan: dict[str, Any]) -> list[int]:
    """The planner's row estimates of every scan of orc_tasks in ``plan``."""
    found = [int(plan["Plan Rows"])] if plan.get("Relation Name") == "orc_tasks" else []
    for child in plan.get("Plans", []):
        found += _estimated_rows(child)
    return found


def test_the_count_of_tasks_in_flight_is_planned_on_the_index_beside_a_big_history(pg_url: str) -> None:
    """20,000 finished tasks, ANALYZEd (autovacuum does as much in any deployment with a
    history): the generic plan of the admission's count of the tasks in flight, as
    ``orc_pass_slot_v1`` runs it (its text read from ``store/sql/pass_slot.sql``), expects a few
    rows of orc_tasks, not the whole table. Before migration 0016 it estimated every row (the
    state compared with a joined value only), and on a big history that plan was a sequential
    scan per completion (``bench/clean.py``: a fan-out at 41 tasks/s instead of 320); the
    functions' results are held by the other tests."""
    st = Store(pg_url, pool_size=1)
    try:
        empty_tables(st.engine)
        st.workers.register("w", default_queues(), 2)
        old = _fan_out(st, 8)
        with st.engine.begin() as conn:
            conn.execute(sa.text("UPDATE orc_tasks SET state = 'SUCCEEDED' WHERE run_id = :r"), {"r": old})
            cols = [
                c
                for c in conn.execute(
                    sa.text("SELECT column_name FROM information_schema.columns WHERE table_name = 'orc_tasks'")
                ).scalars()
            ]
            exprs = ", ".join("md5(src.run_id || '-' || g)" if c == "run_id" else f'src."{c}"' for c in cols)
            names = ", ".join(f'"{c}"' for c in cols)
            conn.execute(
                sa.text(
                    f"INSERT INTO orc_tasks ({names}) SELECT {exprs} FROM orc_tasks AS src,"
                    " generate_series(1, 2000) AS g WHERE src.run_id = :r"
                ),
                {"r": old},
            )
        source = (Path(__file__).resolve().parents[2] / "orchestrator/store/sql/pass_slot.sql").read_text()
        count = source[source.index("SELECT coalesce(sum((SELECT count(*)") : source.index("INTO used")]
        query = count + "FROM unnest($1::text[]) AS q(name)"
        with st.engine.connect() as conn:
            conn.execute(sa.text("ANALYZE orc_tasks"))
            conn.execute(sa.text("SET plan_cache_mode = force_generic_plan"))
            dbapi = conn.connection.driver_connection
            assert dbapi is not None
            dbapi.execute("PREPARE in_flight(text[]) AS " + query)
            plan = dbapi.execute("EXPLAIN (FORMAT JSON) EXECUTE in_flight(ARRAY['orchestrator.default'])").fetchone()
            dbapi.execute("DEALLOCATE in_flight")
            conn.rollback()
        assert plan is not None
        estimates = _estimated_rows(plan[0][0]["Plan"])
        assert estimates and max(estimates) <= 100, estimates
    finally:
        st.dispose()


def test_two_completions_handing_slots_on_at_once_never_overfill_the_window(store: Store) -> None:
    """Two completions of one group (of two runs: nothing else serialises them), each down to
    one message per slot in its own snapshot (the other's task still RUNNING there): the second
    batch is counted again under the group's admission locks once the first committed, so together they
    fill the window, not more."""
    import threading

    store.workers.unregister("w")
    store.workers.register("g1", default_queues(), 2)  # window 2 * depth 2 = 4
    runs = []
    for name in ("one", "two"):
        dag = DAG(name, tenant=name)  # two tenants: fair share admits from both
        for i in range(10):
            dag.task(f"m{i}", "t")
        run_id, _ = store.submission.create_run(
            dag, queues={k: route("default", dag.priority) for k in dag.nodes}, wants_upstream=lambda _: False
        )
        runs.append(run_id)
    assert len(store.admission.admit_ready(100)) == 4

    def queued() -> list[tuple[str, str]]:
        return [(r, t.key) for r in runs for t in store.reads.get_tasks(r) if t.state.value == "QUEUED"]

    in_flight = lambda: sum(_in_flight(store, r) for r in runs)  # noqa: E731
    flying = queued()
    a = next(x for x in flying if x[0] == runs[0])
    b = next(x for x in flying if x[0] == runs[1])
    c = next(x for x in flying if x not in (a, b))
    for run_id, key in (a, b, c):
        assert store.attempts.claim(run_id, key, 1, "g1:7", 30, "t") is not None
    assert store.attempts.succeed(*c, 1, None, 100).dispatches == [] and in_flight() == 3  # no batch yet
    # the group's admission locks (one per queue, migration 0036) held elsewhere, so that both
    # completions reach the batch before either commits
    got: dict[str, int] = {}
    queues = {"qs": default_queues()}
    with store.engine.connect() as blocker:
        blocker.execute(
            sa.text("SELECT pg_advisory_lock(1869767425, hashtext(q)) FROM unnest(CAST(:qs AS text[])) AS q"), queues
        )
        threads = [
            threading.Thread(
                target=lambda x=x: got.__setitem__(x[0], len(store.attempts.succeed(*x, 1, None, 100).dispatches))
            )
            for x in (a, b)
        ]
        for t in threads:
            t.start()
        time.sleep(0.5)  # both waiting for the lock, each having counted 2 in flight
        assert got == {}
        blocker.execute(
            sa.text("SELECT pg_advisory_unlock(1869767425, hashtext(q)) FROM unnest(CAST(:qs AS text[])) AS q"), queues
        )
        blocker.commit()
        for t in threads:
            t.join(10)
    assert sorted(got.values()) == [1, 2] and in_flight() == 4


@pytest.mark.parametrize("bad", [False, True], ids=["clean", "one-call-raises"])
def test_group_commit_runs_the_calls_queued_behind_one_in_flight_in_one_transaction(pg_url: str, bad: bool) -> None:
    """With group commit, the outcomes that threads make while one is in flight (held here by a
    lock on the run's row) go in one transaction: their ledger rows share its ``now()``. A
    group in which one call raises is rolled back and each call made alone: the others are
    accepted once, the bad one raises to its own caller."""
    import threading

    st = Store(pg_url, pool_size=2, group_commit=True)
    hot = st.attempts.hot
    try:
        empty_tables(st.engine)
        st.workers.register("w", default_queues(), 100)
        run_id = _fan_out(st, 16)
        st.admission.admit_ready(10)
        assert st.attempts.claim(run_id, "root", 1, "w", 30, "t") is not None
        assert st.attempts.succeed(run_id, "root", 1, None, 1000).accepted
        st.admission.admit_ready(1000)
        keys = [f"m{i}" for i in range(16)]
        for key in keys:
            assert st.attempts.claim(run_id, key, 1, "w", 30, "t") is not None
        results: dict[str, Any] = {}

        def succeed(key: str) -> None:
            try:
                results[key] = st.attempts.succeed(run_id, key, 1, {"k": key}, 1000).accepted
            except Exception as exc:  # noqa: BLE001 - asserted below
                results[key] = exc

        def divide() -> None:
            try:
                results["bad"] = hot._call("SELECT 1 / %s::int", (0,))
            except Exception as exc:  # noqa: BLE001 - asserted below
                results["bad"] = exc

        with st.engine.connect() as holder:
            holder.execute(sa.text("SELECT 1 FROM orc_runs WHERE id = :r FOR UPDATE"), {"r": run_id})
            first = threading.Thread(target=succeed, args=(keys[0],))
            first.start()
            deadline = time.monotonic() + 10
            while not hot._leading and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.2)  # the first call waits on the run's row
            rest = [threading.Thread(target=succeed, args=(k,)) for k in keys[1:]]
            if bad:
                rest.insert(7, threading.Thread(target=divide))
            for t in rest:
                t.start()
            while len(hot._queued) < len(rest) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(hot._queued) == len(rest)
            holder.commit()  # releases the row: the first call commits, then the group
        for t in [first, *rest]:
            t.join(30)
        assert {k: results[k] for k in keys} == {k: True for k in keys}
        with st.engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT key, at FROM orc_task_events WHERE run_id = :r AND to_state = 'SUCCEEDED'"
                    " AND key LIKE 'm%' AND accepted"
                ),
                {"r": run_id},
            ).all()
        assert sorted(r.key for r in rows) == sorted(keys)  # each once
        stamps = {r.at for r in rows if r.key != keys[0]}
        if bad:
            assert "division by zero" in str(results["bad"])
            assert (hot.groups, hot.groups_failed) == (0, 1)
            assert len(stamps) == 15  # made alone, one transaction each
        else:
            assert (hot.groups, hot.grouped_calls, hot.groups_failed) == (1, 15, 0)
            assert len(stamps) == 1  # one transaction
        assert {t.key: t.state for t in st.reads.get_tasks(run_id)}["sink"] in {T.READY, T.QUEUED}
    finally:
        hot.close()
        st.dispose()
