"""A fan-in's last arrivals (migration 0037: the settlement told what it read by the success's own
compare-and-set, the run closed by orc_close_v1): the last parent's success dispatches the join in
its own transaction and the run closes with the join's; two last parents at once, the second
waiting for the first's lock on the join's row, make the join READY once, dispatched by the one
that saw the last count."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG
from orchestrator.core.routing import default_queues, route
from orchestrator.store import Store
from tests.conftest import empty_tables

pytestmark = pytest.mark.postgres

SUCCEED = sa.text("SELECT orc_succeed_v2(:r, :k, 1, CAST('null' AS json), 100, 30, 2, 300)")


@pytest.fixture
def store(pg_url: str) -> Iterator[Store]:
    st = Store(pg_url)
    empty_tables(st.engine)
    st.workers.register("g1", default_queues(), 2)
    yield st
    st.attempts.hot.close()
    st.dispose()


def _submit(store: Store, dag: DAG) -> str:
    run_id, _ = store.submission.create_run(
        dag, queues={k: route("default", dag.priority) for k in dag.nodes}, wants_upstream=lambda _: False
    )
    return run_id


def _fan_in(store: Store, width: int) -> str:
    dag = DAG("order")
    dag.task("root", "t")
    for i in range(width):
        dag.task(f"m{i}", "t", upstream=["root"])
    dag.task("sink", "t", upstream=[f"m{i}" for i in range(width)])
    return _submit(store, dag)


def _state(store: Store, run_id: str, key: str) -> str:
    return store.reads.get_task(run_id, key).state.value


def _run_it(store: Store, run_id: str, key: str) -> None:
    """Admit what is READY, then claim ``key`` (QUEUED by now) as worker g1's process."""
    store.admission.admit_ready(100)
    assert store.attempts.claim(run_id, key, 1, "g1:7", 30, "t") is not None


def test_the_last_arrival_dispatches_the_join_and_closes_nothing_early(store: Store) -> None:
    run_id = _fan_in(store, 3)
    _run_it(store, run_id, "root")
    assert store.attempts.succeed(run_id, "root", 1, None, 100).accepted
    got = []
    for key in ("m0", "m1", "m2"):
        _run_it(store, run_id, key)
        out = store.attempts.succeed(run_id, key, 1, None, 100)
        assert out.accepted
        got.append([d.key for d in out.dispatches])
    assert got[-1] == ["sink"] and "sink" not in got[0] + got[1]
    assert _state(store, run_id, "sink") == "QUEUED"
    assert store.reads.get_run(run_id).state.value == "RUNNING"
    assert store.attempts.claim(run_id, "sink", 1, "g1:7", 30, "t") is not None
    assert store.attempts.succeed(run_id, "sink", 1, None, 100).accepted
    assert store.reads.get_run(run_id).state.value == "SUCCEEDED"


def test_two_last_arrivals_at_once_make_the_join_ready_once(store: Store, pg_url: str) -> None:
    """m0 and m1 are the last two parents of the join. m0's success is held uncommitted; m1's
    success waits for m0's lock on the join's row (or the group's admission lock m0 took); when m0
    commits, m1's settlement counts the last arrival and makes the join READY: its own
    transaction dispatches it, and the ledger has the join READY once."""
    run_id = _fan_in(store, 2)
    _run_it(store, run_id, "root")
    assert store.attempts.succeed(run_id, "root", 1, None, 100).accepted
    for key in ("m0", "m1"):
        _run_it(store, run_id, key)
    # connections of their own (the store's pool is small): m0's, m1's and the watcher's
    engine = sa.create_engine(pg_url, poolclass=sa.pool.NullPool)
    holder = engine.connect()
    trans = holder.begin()
    first = holder.execute(SUCCEED, {"r": run_id, "k": "m0"}).scalar_one()
    assert first["accepted"] and first["dispatches"] == []
    result: dict[str, Any] = {}

    def second() -> None:
        try:
            with engine.begin() as conn:
                result["out"] = conn.execute(SUCCEED, {"r": run_id, "k": "m1"}).scalar_one()
        except Exception as exc:  # noqa: BLE001 - asserted below
            result["error"] = exc

    t = threading.Thread(target=second)
    t.start()
    try:
        # m1 waits for a lock m0 holds (the group's admission lock, then the join's row): seen
        # in pg_stat_activity, not timed
        with engine.connect() as conn:
            deadline = time.monotonic() + 300  # a bound on a hang, not a timing: m1 waits until m0 commits
            while time.monotonic() < deadline:
                waiting = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock' AND query LIKE '%orc_succeed_v2%'"
                    )
                ).scalar_one()
                if waiting or not t.is_alive():
                    break
                t.join(0.01)
            assert waiting, "the second success never waited for the first's lock"
        trans.commit()
    finally:
        if trans.is_active:
            trans.rollback()
        holder.close()
        t.join(60)
        engine.dispose()
    assert "error" not in result, result
    out = result["out"]
    assert out["accepted"] and [d["key"] for d in out["dispatches"]] == ["sink"]
    assert _state(store, run_id, "sink") == "QUEUED"
    with store.engine.connect() as conn:
        ledger = conn.execute(
            sa.text("SELECT from_state, to_state FROM orc_task_events WHERE run_id = :r AND key = 'sink' ORDER BY id"),
            {"r": run_id},
        ).all()
    assert [tuple(r) for r in ledger] == [("PENDING", "READY"), ("READY", "QUEUED")]
