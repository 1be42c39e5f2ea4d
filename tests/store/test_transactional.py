"""Transactional tasks on the store (``dag.task(..., transactional=True)``): the refusals at
authoring and at submit, the spec round trip, the claim's flag (never a direct message), and the
success committed in the attempt's own transaction with the body's writes, or (fenced) rolled
back with them and the refusal written after the rollback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, Settings, TransactionalError
from orchestrator.core.dag import dag_from_spec
from orchestrator.core.dag.model import Node
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues, route
from orchestrator.core.waits import WaitSpec
from orchestrator.store import Store

WRITES = "txn_store_probe"


@pytest.fixture
def store(pg_clean: str) -> Iterator[Store]:
    store = Store(pg_clean)
    store.workers.register("w", default_queues(), 10)
    with store.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE IF NOT EXISTS {WRITES} (run_id text, attempt int)"))
        conn.execute(sa.text(f"DELETE FROM {WRITES}"))
    try:
        yield store
    finally:
        store.dispose()


def _orc(store: Store, url: str, **settings: float) -> Orchestrator:
    return Orchestrator(
        Settings(database_url=url, **settings),  # type: ignore[arg-type]
        store=store,
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t", "check"]),
    )


def _claimed(store: Store, *, transactional: bool = True) -> str:
    """A run of one task ``a`` (transactional unless told), admitted and claimed: its run id."""
    dag = DAG("txn")
    dag.task("a", "t", max_attempts=3, transactional=transactional, time_limit=10)
    run_id, _ = store.submission.create_run(
        dag, queues={"a": route("default", dag.priority)}, wants_upstream=lambda _: False
    )
    dispatches = store.admission.admit_ready(10)
    assert [(d.key, d.direct) for d in dispatches] == [("a", not transactional)], "a transactional task is never direct"
    claim = store.attempts.claim(run_id, "a", 1, "w", 30, "t")
    assert claim is not None and claim.transactional is transactional
    return run_id


def _rows(store: Store, run_id: str) -> list[int]:
    with store.engine.connect() as conn:
        return list(conn.execute(sa.text(f"SELECT attempt FROM {WRITES} WHERE run_id = :r"), {"r": run_id}).scalars())


def test_the_forms_that_hold_no_worker_are_refused() -> None:
    dag = DAG("forms")
    dag.sensor("s", "check", every=1, transactional=True)
    with pytest.raises(TransactionalError, match="cannot be a sensor") as caught:
        dag.validate(lambda _: True)
    assert caught.value.node == "s"
    dag = DAG("forms")
    dag.nodes["w"] = Node("w", "orchestrator.wait", wait=WaitSpec.make(delay=5), transactional=True)
    with pytest.raises(TransactionalError, match="cannot be a wait"):
        dag.validate(lambda _: True)
    dag = DAG("forms")
    dag.nodes["x"] = Node("x", "t", transactional="yes")  # type: ignore[arg-type]
    with pytest.raises(TransactionalError, match="true or false"):
        dag.validate(lambda _: True)


def test_a_time_limit_above_the_lease_is_refused_at_submit(store: Store, pg_clean: str) -> None:
    orc = _orc(store, pg_clean, lease_seconds=10, max_time_limit=60)
    dag = DAG("limits")
    dag.task("a", "t", transactional=True, time_limit=11)
    with pytest.raises(TransactionalError, match=r"time_limit \(11s\) exceeds ORCHESTRATOR_LEASE_SECONDS \(10s\)"):
        orc.submit(dag)
    dag = DAG("limits")
    dag.task("a", "t", transactional=True)  # no limit of its own: the deployment's 60 s applies
    with pytest.raises(TransactionalError, match=r"ORCHESTRATOR_MAX_TIME_LIMIT \(60s\) exceeds"):
        orc.submit(dag)
    dag = DAG("limits")
    dag.task("a", "t", transactional=True, time_limit=10)
    dag.task("b", "t", time_limit=60)  # a task that is not transactional is not bound by the lease
    run = orc.submit(dag)
    assert store.reads.get_task(run.id, "a").state.value == "QUEUED"


def test_the_spec_round_trips_the_flag() -> None:
    dag = DAG("spec")
    dag.task("a", "t", transactional=True, time_limit=5)
    dag.task("b", "t")
    spec = dag.to_spec()
    assert [n.get("transactional") for n in spec["nodes"]] == [True, None]
    again = dag_from_spec(spec)
    assert again.nodes["a"].transactional is True and again.nodes["b"].transactional is False
    assert again.to_spec() == spec


def test_a_success_commits_with_the_body_writes(store: Store) -> None:
    run_id = _claimed(store)
    txn = store.attempts.begin(run_id, "a", 1, 30)
    txn.connection.execute(sa.text(f"INSERT INTO {WRITES} VALUES (:r, 1)"), {"r": run_id})
    assert _rows(store, run_id) == [], "not visible before the commit"
    outcome = store.attempts.succeed_in(txn, {"ok": True}, 10)
    txn.close()
    assert outcome.accepted
    assert _rows(store, run_id) == [1]
    task = store.reads.get_task(run_id, "a")
    assert task.state.value == "SUCCEEDED" and task.result == {"ok": True}


def test_a_fenced_commit_rolls_back_the_body_writes(store: Store, pg_clean: str) -> None:
    run_id = _claimed(store)
    txn = store.attempts.begin(run_id, "a", 1, 30)
    txn.connection.execute(sa.text(f"INSERT INTO {WRITES} VALUES (:r, 1)"), {"r": run_id})
    # an operator clears the task while its body runs: attempt 1 no longer holds it
    assert _orc(store, pg_clean).clear(run_id, "a", by="test") == ["a"]
    outcome = store.attempts.succeed_in(txn, {"ok": True}, 10)
    txn.close()
    assert not outcome.accepted and outcome.conflict is not None
    assert _rows(store, run_id) == [], "the fenced attempt's write was rolled back"
    task = store.reads.get_task(run_id, "a")
    assert task.attempt == 2 and task.state.value != "SUCCEEDED"
    refused = [e for e in store.reads.events(run_id) if e.key == "a" and not e.accepted]
    assert [(e.attempt, e.to_state) for e in refused] == [(1, "SUCCEEDED")]
    assert (refused[0].reason or "").startswith("transactional attempt fenced: its writes rolled back; row holds ")


def test_a_result_the_node_cannot_use_rolls_back_and_fails(store: Store) -> None:
    dag = DAG("branchy")
    a = dag.task("a", "t", branch=True, transactional=True, time_limit=10)
    dag.task("b", "t", upstream=[a])
    run_id, _ = store.submission.create_run(
        dag, queues={k: route("default", dag.priority) for k in dag.nodes}, wants_upstream=lambda _: False
    )
    store.admission.admit_ready(10)
    assert store.attempts.claim(run_id, "a", 1, "w", 30, "t") is not None
    txn = store.attempts.begin(run_id, "a", 1, 30)
    txn.connection.execute(sa.text(f"INSERT INTO {WRITES} VALUES (:r, 1)"), {"r": run_id})
    outcome = store.attempts.succeed_in(txn, "nope", 10)  # no such child
    txn.close()
    assert outcome.accepted and outcome.state is not None and outcome.state.value == "FAILED"
    assert _rows(store, run_id) == []
    assert (store.reads.get_task(run_id, "a").error or "").startswith("BranchError")


def test_a_direct_claim_folded_into_a_success_refuses_a_transactional_task(store: Store) -> None:
    dag = DAG("direct")
    dag.task("a", "t", transactional=True, time_limit=10)
    run_id, _ = store.submission.create_run(
        dag, queues={"a": route("default", dag.priority)}, wants_upstream=lambda _: False
    )
    store.admission.admit_ready(10)
    a = store.admission
    out = store.attempts.hot.claim_succeed(run_id, "a", 1, "w", "t", 0.0, None, 10, a.worker_ttl, a.depth, a.aging)
    assert out["accepted"] is False
    assert store.reads.get_task(run_id, "a").state.value == "QUEUED"


def test_a_coroutine_body_is_refused_when_it_runs(store: Store, pg_clean: str) -> None:
    from types import SimpleNamespace

    from celery.exceptions import Ignore

    from orchestrator.core.protocol import FencingToken
    from orchestrator.runtime import transactional

    async def body() -> None:
        return None

    run_id = _claimed(store)
    orc = _orc(store, pg_clean)
    with pytest.raises(Ignore):
        transactional.open_for(orc, SimpleNamespace(run=body), FencingToken(run_id, "a", 1))
    task = store.reads.get_task(run_id, "a")
    assert task.state.value == "FAILED" and task.attempt == 1, "no retry"
    assert (task.error or "").startswith("TransactionalError: a coroutine body (async def) cannot be transactional")


def test_a_transactional_map_makes_transactional_children(store: Store) -> None:
    dag = DAG("txn-map")
    dag.map("m", "t", over=[10, 20], kwarg="item", transactional=True, time_limit=10)
    run_id, _ = store.submission.create_run(
        dag, queues={"m": route("default", dag.priority)}, wants_upstream=lambda _: False
    )
    dispatches = store.admission.admit_ready(10)
    assert sorted((d.key, d.direct) for d in dispatches) == [("m[0]", False), ("m[1]", False)]
    claim = store.attempts.claim(run_id, "m[1]", 1, "w", 30, "t")
    assert claim is not None and claim.transactional and claim.kwargs == {"item": 20}
