"""The store's contract, run against SQLite and Postgres alike (one body, two backends)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from orchestrator import DAG, TaskState, TriggerRule
from orchestrator import schema as s
from orchestrator.dbtime import db_after
from orchestrator.routing import default_queues, route
from orchestrator.states import RunState
from orchestrator.store import Store

T = TaskState


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        st = Store(f"sqlite:///{tmp_path / 'store.db'}")
        st.create_schema()
    else:
        st = Store(request.getfixturevalue("pg_url"))
        with st.engine.begin() as conn:
            for table in reversed(s.metadata.sorted_tables):
                conn.execute(table.delete())
    st.register_worker("test-worker", default_queues(), 10_000)
    yield st
    st.dispose()


def submit(store: Store, dag: DAG, key: str | None = None) -> str:
    queues = {n.key: route(dag.tenant, dag.priority_of(n), n.queue) for n in dag.nodes.values()}
    run_id, _ = store.create_run(dag, queues=queues, wants_upstream=lambda name: True, idempotency_key=key)
    return run_id


def state(store: Store, run_id: str, key: str) -> TaskState:
    return store.get_task(run_id, key).state


def run_task(store: Store, run_id: str, key: str, result: object = None, *, ok: bool = True) -> None:
    """Dispatch (if needed), claim and finish one task as a worker would."""
    store.admit_ready(10_000)  # finished parents already admit their children
    task = store.get_task(run_id, key)
    assert task.state is T.QUEUED, (key, task.state)
    claim = store.claim(run_id, key, task.attempt, "w1", 30)
    assert claim is not None
    if ok:
        assert store.succeed(run_id, key, task.attempt, result, 10_000).accepted
    else:
        assert store.fail(run_id, key, task.attempt, error="boom", retryable=False, window=10_000).accepted


def diamond() -> DAG:
    dag = DAG("diamond", tenant="acme")
    a = dag.task("a", "t")
    b = dag.task("b", "t", upstream=[a])
    c = dag.task("c", "t", upstream=[a])
    dag.task("d", "t", upstream=[b, c])
    return dag


def test_submit_writes_run_tasks_edges_and_root_events(store: Store) -> None:
    run_id = submit(store, diamond())
    view = store.get_run(run_id)
    assert view.state is RunState.RUNNING and view.task_count == 4 and view.open_tasks == 4
    assert view.counts == {"READY": 1, "PENDING": 3}
    events = store.events(run_id)
    assert [(e.key, e.from_state, e.to_state) for e in events] == [("a", "PENDING", "READY")]


def test_idempotent_submit_returns_the_same_run(store: Store) -> None:
    first = submit(store, diamond(), "k1")
    assert submit(store, diamond(), "k1") == first
    assert submit(store, diamond(), "k2") != first
    assert submit(store, diamond().with_tenant("other"), "k1") != first


def test_concurrent_idempotent_submits_create_one_run(store: Store) -> None:
    ids: list[str] = []
    errors: list[BaseException] = []

    def go() -> None:
        try:
            ids.append(submit(store, diamond(), "same"))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(ids)) == 1


def test_diamond_runs_to_success_with_results_for_children(store: Store) -> None:
    run_id = submit(store, diamond())
    run_task(store, run_id, "a", {"n": 1})
    assert state(store, run_id, "b") is T.QUEUED and state(store, run_id, "d") is T.PENDING
    run_task(store, run_id, "b", "B")
    assert state(store, run_id, "d") is T.PENDING
    run_task(store, run_id, "c", "C")
    store.admit_ready(100)
    claim = store.claim(run_id, "d", 1, "w", 30)
    assert claim is not None and claim.upstream_results == {"b": "B", "c": "C"}
    assert store.succeed(run_id, "d", 1, [1, 2], 100).accepted
    view = store.get_run(run_id)
    assert view.state is RunState.SUCCEEDED and view.open_tasks == 0 and view.finished_at is not None


def test_claim_is_fenced_by_attempt_and_recorded_when_rejected(store: Store) -> None:
    run_id = submit(store, diamond())
    store.admit_ready(100)
    assert store.claim(run_id, "a", 2, "w", 30) is None  # stale/forged attempt
    assert store.claim(run_id, "a", 1, "w1", 30) is not None
    assert store.claim(run_id, "a", 1, "w2", 30) is None  # duplicate delivery
    assert store.claim("nope", "a", 1, "w", 30) is None  # unknown run
    rejected = [e for e in store.events(run_id) if not e.accepted]
    assert len(rejected) == 2 and all(e.to_state == "RUNNING" for e in rejected)
    assert "row holds RUNNING attempt 1" in (rejected[1].reason or "")


def test_result_commit_happens_once(store: Store) -> None:
    run_id = submit(store, diamond())
    store.admit_ready(100)
    store.claim(run_id, "a", 1, "w", 30)
    assert store.succeed(run_id, "a", 1, "first", 100).accepted
    again = store.succeed(run_id, "a", 1, "second", 100)
    assert not again.accepted
    assert store.get_task(run_id, "a").result == "first"
    accepted = [e for e in store.events(run_id) if e.key == "a" and e.to_state == "SUCCEEDED"]
    assert [e.accepted for e in accepted] == [True, False]


def test_failure_retries_with_backoff_in_the_database(store: Store) -> None:
    dag = DAG("r")
    dag.task("a", "t", max_attempts=2, backoff={"base": 0.2, "cap": 0.2, "jitter": "none"})
    run_id = submit(store, dag)
    store.admit_ready(100)
    store.claim(run_id, "a", 1, "w", 30)
    out = store.fail(run_id, "a", 1, error="E: transient", window=100)
    assert out.accepted and out.state is T.RETRYING
    task = store.get_task(run_id, "a")
    assert task.attempt == 2 and task.not_before is not None
    assert store.release_due_retries(100)[0] == 0  # not yet due
    time.sleep(0.3)
    released, dispatches = store.release_due_retries(100)
    assert released == 1 and [(d.key, d.attempt) for d in dispatches] == [("a", 2)]
    assert dispatches[0].task_id == f"{run_id}.a.2"
    store.claim(run_id, "a", 2, "w", 30)
    out = store.fail(run_id, "a", 2, error="E: again", window=100)
    assert out.state is T.FAILED  # attempts exhausted
    assert store.get_run(run_id).state is RunState.FAILED


def test_failure_cascades_through_trigger_rules(store: Store) -> None:
    dag = DAG("rules")
    a = dag.task("a", "t")
    b = dag.task("b", "t", upstream=[a])  # all_success -> UPSTREAM_FAILED
    dag.task("c", "t", upstream=[b])  # cascades
    dag.task("cleanup", "t", upstream=[a], trigger_rule=TriggerRule.ONE_FAILED)
    dag.task("always", "t", upstream=[b], trigger_rule=TriggerRule.ALL_DONE)
    dag.task("skipped", "t", upstream=[a], trigger_rule=TriggerRule.ALL_FAILED)
    dag.task("after_skip", "t", upstream=["skipped"])
    run_id = submit(store, dag)
    run_task(store, run_id, "a", ok=False)
    states = {t.key: t.state for t in store.get_tasks(run_id)}
    assert states["b"] is T.UPSTREAM_FAILED and states["c"] is T.UPSTREAM_FAILED
    assert states["cleanup"] is T.QUEUED and states["always"] is T.QUEUED
    assert states["skipped"] is T.QUEUED and states["after_skip"] is T.PENDING
    run_task(store, run_id, "skipped", "ran")
    run_task(store, run_id, "cleanup")
    run_task(store, run_id, "always")
    run_task(store, run_id, "after_skip")
    view = store.get_run(run_id)
    assert view.state is RunState.FAILED and view.open_tasks == 0


def test_skips_propagate(store: Store) -> None:
    dag = DAG("skip")
    a = dag.task("a", "t")
    b = dag.task("b", "t", upstream=[a], trigger_rule=TriggerRule.ONE_FAILED)
    dag.task("c", "t", upstream=[b])
    dag.task("d", "t", upstream=[b], trigger_rule=TriggerRule.NONE_FAILED)
    run_id = submit(store, dag)
    run_task(store, run_id, "a")
    states = {t.key: t.state for t in store.get_tasks(run_id)}
    assert states == {"a": T.SUCCEEDED, "b": T.SKIPPED, "c": T.SKIPPED, "d": T.QUEUED}
    run_task(store, run_id, "d")
    assert store.get_run(run_id).state is RunState.SUCCEEDED


def test_admission_window_bounds_the_broker(store: Store) -> None:
    dag = DAG("wide", priority="low")
    for i in range(30):
        dag.task(f"n{i}", "t")
    high = DAG("urgent", priority="high")
    high.task("x", "t")
    low_run = submit(store, dag)
    high_run = submit(store, high)
    first = store.admit_ready(10)
    assert len(first) == 10 and first[0].run_id == high_run  # priority order
    assert store.admit_ready(10) == []  # window full
    run_id, key = first[1].run_id, first[1].key
    assert run_id == low_run
    store.claim(run_id, key, 1, "w", 30)
    out = store.succeed(run_id, key, 1, None, 10)
    assert len(out.dispatches) == 1  # a finished task frees one slot


def test_heartbeat_extends_only_the_current_attempt(store: Store) -> None:
    run_id = submit(store, diamond())
    store.admit_ready(10)
    store.claim(run_id, "a", 1, "w", 1)
    before = store.get_task(run_id, "a")
    assert store.heartbeat(run_id, "a", 1, 60)
    assert not store.heartbeat(run_id, "a", 2, 60)
    with store.engine.connect() as conn:
        lease = conn.execute(sa.select(s.tasks.c.lease_expires_at).where(s.tasks.c.key == "a")).scalar_one()
    assert before.started_at is not None
    assert lease is not None


def test_ten_thousand_node_submit_is_bulk(store: Store) -> None:
    dag = DAG("big")
    root = dag.task("root", "t")
    for i in range(10_000 - 1):
        dag.task(f"n{i}", "t", upstream=[root])
    statements: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    run_id = submit(store, dag)
    assert store.get_run(run_id).task_count == 10_000
    assert len(statements) < 50, len(statements)


def test_concurrent_parents_release_a_fan_in_child_once(store: Store) -> None:
    dag = DAG("fanin")
    parents = [dag.task(f"p{i}", "t") for i in range(20)]
    dag.task("child", "t", upstream=parents)
    run_id = submit(store, dag)
    store.admit_ready(100)
    for p in parents:
        store.claim(run_id, p.key, 1, "w", 30)
    results: list[int] = []

    def finish(key: str) -> None:
        out = store.succeed(run_id, key, 1, key, 100)
        results.append(len(out.dispatches))

    threads = [threading.Thread(target=finish, args=(p.key,)) for p in parents]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 1  # the child is dispatched exactly once
    child = store.get_task(run_id, "child")
    assert child.state is T.QUEUED
    queued = [e for e in store.events(run_id) if e.key == "child" and e.to_state == "QUEUED" and e.accepted]
    assert len(queued) == 1


def test_admission_is_bounded_by_live_worker_capacity(store: Store) -> None:
    store.unregister_worker("test-worker")
    dag = DAG("cap")
    for i in range(10):
        dag.task(f"n{i}", "t")
    run_id = submit(store, dag)
    assert store.admit_ready(1000) == []  # no live worker: the backlog waits as READY
    store.register_worker("w1", ["orchestrator.default"], 2)
    store.register_worker("w2", ["orchestrator.default"], 1)
    assert len(store.admit_ready(1000)) == 3  # exactly the free slots
    assert store.admit_ready(1000) == []
    store.register_worker("w1", ["orchestrator.default"], 2)
    with store.engine.begin() as conn:  # both workers go silent past the TTL
        conn.execute(s.workers.update().values(seen_at=db_after(-3600)))
    assert store.get_run(run_id).counts["QUEUED"] == 3
    store.register_worker("w3", ["orchestrator.default"], 5)
    assert len(store.admit_ready(1000)) == 2  # 5 slots, 3 already in flight


def test_stale_dispatch_is_republished_once(store: Store) -> None:
    run_id = submit(store, diamond())
    store.admit_ready(100)
    time.sleep(0.05)
    stale = store.stale_queued(0.01)
    assert [(r, k, a) for r, k, a, _ in stale] == [(run_id, "a", 1)]
    first = store.redispatch(*stale[0])
    second = store.redispatch(*stale[0])  # a second reconciler with the same stale read
    assert first is not None and first.task_id == f"{run_id}.a.1" and second is None
    ledger = [(e.from_state, e.to_state, e.accepted) for e in store.events(run_id) if e.actor == "reconciler"]
    assert ledger == [("QUEUED", "QUEUED", True), ("QUEUED", "QUEUED", False)]


def test_expired_lease_fails_the_attempt_and_crash_loops_dead_letter(store: Store) -> None:
    dag = DAG("lease")
    dag.task("a", "t", max_attempts=5, backoff={"base": 0.01, "cap": 0.01})
    run_id = submit(store, dag)
    store.admit_ready(100)
    store.claim(run_id, "a", 1, "w", 30)
    assert store.expired_leases(5.0) == []
    time.sleep(0.05)
    assert store.expired_leases(0.01) == [(run_id, "a", 1)]
    out = store.lose_lease(run_id, "a", 1, 0.01, 100)
    assert out.accepted and out.state is T.RETRYING
    assert not store.lose_lease(run_id, "a", 1, 0.01, 100).accepted  # a second reconciler loses
    time.sleep(0.05)
    store.release_due_retries(100)
    store.claim(run_id, "a", 2, "w", 30)
    time.sleep(0.05)
    out = store.lose_lease(run_id, "a", 2, 0.01, 100)
    assert out.state is T.DEAD_LETTER  # two lost leases in a row: crash loop
    task = store.get_task(run_id, "a")
    assert "crash loop" in (task.error or "")
    view = store.get_run(run_id)
    assert view.state is RunState.RUNNING and view.needs_attention


def test_same_fingerprint_twice_is_poison(store: Store) -> None:
    dag = DAG("poison")
    dag.task("a", "t", max_attempts=5, backoff={"base": 0.01, "cap": 0.01})
    dag.task("b", "t", upstream=["a"])
    run_id = submit(store, dag)
    store.admit_ready(100)
    store.claim(run_id, "a", 1, "w", 30)
    assert store.fail(run_id, "a", 1, error="E", window=100, fingerprint="fp1").state is T.RETRYING
    time.sleep(0.05)
    store.release_due_retries(100)
    store.claim(run_id, "a", 2, "w", 30)
    assert store.fail(run_id, "a", 2, error="E", window=100, fingerprint="fp1").state is T.DEAD_LETTER
    assert state(store, run_id, "b") is T.PENDING  # DEAD_LETTER does not cascade
    # the operator retries it, it fails again differently, then the operator skips it
    store.retry_task(run_id, "a", 100)
    store.claim(run_id, "a", 3, "w", 30)
    assert store.fail(run_id, "a", 3, error="F", window=100, fingerprint="fp2").state is T.RETRYING
    time.sleep(0.05)
    store.release_due_retries(100)
    store.claim(run_id, "a", 4, "w", 30)
    assert store.fail(run_id, "a", 4, error="F", window=100, fingerprint="fp2").state is T.DEAD_LETTER
    store.resolve_dead_letter(run_id, "a", T.SKIPPED, 100)
    assert state(store, run_id, "b") is T.SKIPPED
    assert store.get_run(run_id).state is RunState.SUCCEEDED


def test_retry_on_and_no_retry_on(store: Store) -> None:
    dag = DAG("classes")
    dag.task("a", "t", max_attempts=3, no_retry_on=["ValueError"])
    dag.task("b", "t", max_attempts=3, retry_on=["TimeoutError"])
    run_id = submit(store, dag)
    store.admit_ready(100)
    store.claim(run_id, "a", 1, "w", 30)
    store.claim(run_id, "b", 1, "w", 30)
    assert store.fail(run_id, "a", 1, error="v", window=100, exc_types=["ValueError"]).state is T.FAILED
    assert store.fail(run_id, "b", 1, error="k", window=100, exc_types=["KeyError"]).state is T.FAILED


def test_operator_retry_of_a_failed_leaf_reopens_the_run(store: Store) -> None:
    dag = DAG("leaf")
    dag.task("a", "t")
    run_id = submit(store, dag)
    run_task(store, run_id, "a", ok=False)
    assert store.get_run(run_id).state is RunState.FAILED
    store.retry_task(run_id, "a", 100)
    assert store.get_run(run_id).state is RunState.RUNNING
    run_task(store, run_id, "a", "ok")
    assert store.get_run(run_id).state is RunState.SUCCEEDED
    from orchestrator.errors import OperatorError

    with pytest.raises(OperatorError, match="only DEAD_LETTER or FAILED"):
        store.retry_task(run_id, "a", 100)


def test_cancel_run(store: Store) -> None:
    run_id = submit(store, diamond())
    store.admit_ready(100)
    store.claim(run_id, "a", 1, "w", 30)
    revoke = store.cancel_run(run_id)
    assert revoke == [f"{run_id}.a.1"]
    assert {t.state for t in store.get_tasks(run_id)} == {T.CANCELLED}
    assert store.get_run(run_id).state is RunState.CANCELLED
    assert not store.succeed(run_id, "a", 1, "late", 100).accepted  # the late result is rejected
    from orchestrator.errors import OperatorError

    with pytest.raises(OperatorError, match="already CANCELLED"):
        store.cancel_run(run_id)
