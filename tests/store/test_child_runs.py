"""Child runs (``DAG.run_dag``, issue 34) on a real Postgres: the node waits as a row (WAITING, no
slot), its child is started once per attempt however often the start is called, the child's
success ends the node with its leaf results, a failed child starts a new child on the next
attempt and fails the node at the last, ``wait=False``, the parent-end policies under a cancel and
a clear of the parent, lineage, the spec format, and a bad ``dag=`` refused. The workers' part is
``dynamic.drive``; the engine's child pass is called as the reconciler calls it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, ValidationError
from orchestrator.core.dag import dag_from_spec
from orchestrator.services.invariants import check_runs
from orchestrator.store import schema as s
from tests.store.dynamic import Fail, drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def child_dag(fail: bool = False) -> DAG:
    dag = DAG("etl")
    dag.task("extract", "t", kwargs={"fail": fail})
    dag.task("load", "up", upstream=["extract"])
    return dag


def parent_dag(child: Any, **options: Any) -> DAG:
    dag = DAG("parent")
    dag.task("a", "t")
    dag.run_dag("kid", dag=child, params={"day": "2026-11-29"}, upstream=["a"], **options)
    dag.task("b", "up", upstream=["kid"])
    return dag


def body(key: str, kwargs: dict[str, Any], upstream: dict[str, Any]) -> Any:
    if kwargs.get("fail"):
        raise Fail("boom")
    return {"key": key, "upstream": sorted(upstream)}


def children(orc: Orchestrator, run_id: str) -> list[Any]:
    with orc.store.engine.connect() as conn:
        return list(
            conn.execute(sa.select(s.runs).where(s.runs.c.parent_run_id == run_id).order_by(s.runs.c.created_at)).all()
        )


def task_row(orc: Orchestrator, run_id: str, key: str) -> Any:
    with orc.store.engine.connect() as conn:
        return conn.execute(sa.select(s.tasks).where(s.tasks.c.run_id == run_id, s.tasks.c.key == key)).one()


def run_all(orc: Orchestrator, run_id: str, work: Callable[..., Any] = body, rounds: int = 20) -> None:
    """The workers and the reconciler's child pass, until nothing moves: the parent run, then
    every child run, then the pass again."""
    for _ in range(rounds):
        ran = len(drive(orc, DAG("x"), work, run_id=run_id).ran)
        for child in children(orc, run_id):
            ran += len(drive(orc, DAG("x"), work, run_id=child.id).ran)
        ran += orc.children.tick()
        if not ran:
            return


def annotations(orc: Orchestrator, run_id: str, key: str) -> list[str]:
    return [e.reason for e in orc.ledger(run_id) if e.key == key and e.from_state == e.to_state and e.accepted]


def test_the_node_waits_as_a_row_and_its_child_is_started_once_per_attempt(orc: Orchestrator) -> None:
    d = drive(orc, parent_dag(child_dag()), body)
    assert d.states() == {"a": "SUCCEEDED", "kid": "WAITING", "b": "PENDING"}
    kid = task_row(orc, d.run_id, "kid")
    assert kid.child_run_id is None and kid.worker is None and kid.waiting["kind"] == "child"
    waits = [e.reason for e in orc.ledger(d.run_id) if e.key == "kid" and e.to_state == "WAITING"]
    assert waits and waits[0].endswith("waits for its child run")
    assert orc.explain(d.run_id, "kid")[0].reasons[0].detail.startswith("waiting on child run (being started)")
    pending = orc.store.children.to_start()
    assert [(p.run_id, p.key, p.attempt) for p in pending] == [(d.run_id, "kid", 1)]
    # a duplicate start (two passes, a pass that died after its commit) finds the child by its key
    assert orc.children.start(pending[0]) is True
    assert orc.children.start(pending[0]) is False
    assert orc.children.tick() == 0 and orc.store.children.to_start() == []
    (child,) = children(orc, d.run_id)
    assert (child.parent_key, child.parent_attempt, child.tenant) == ("kid", 1, "default")
    assert child.idempotency_key == f"child:{d.run_id}:kid:1" and child.params == {"day": "2026-11-29"}
    assert task_row(orc, d.run_id, "kid").child_run_id == child.id
    assert annotations(orc, d.run_id, "kid") == [f"started child run {child.id} (etl)"]
    assert [e.reason for e in orc.ledger(child.id) if e.kind == "child_run"] == [
        f"child of run {d.run_id} (task kid, attempt 1)"
    ]
    assert orc.explain(d.run_id, "kid")[0].reasons[0].detail.startswith(f"waiting on child run {child.id}")
    assert orc.children.lineage(child.id)["parent"] == {"run_id": d.run_id, "key": "kid", "attempt": 1}
    assert [c["run_id"] for c in orc.children.lineage(d.run_id)["children"]] == [child.id]


def test_the_childs_success_ends_the_node_with_its_leaf_results(orc: Orchestrator) -> None:
    d = drive(orc, parent_dag(child_dag()), body)
    run_all(orc, d.run_id)
    (child,) = children(orc, d.run_id)
    assert orc.run_state(child.id).value == "SUCCEEDED"
    assert orc.task(d.run_id, "kid").result == {"load": {"key": "load", "upstream": ["extract"]}}
    assert d.states() == {"a": "SUCCEEDED", "kid": "SUCCEEDED", "b": "SUCCEEDED"}
    assert d.run_state() == "SUCCEEDED"
    done = [e for e in orc.ledger(d.run_id) if e.key == "kid" and e.to_state == "SUCCEEDED"]
    assert [e.reason for e in done] == [f"child run {child.id} SUCCEEDED"]
    # a second completion of the same child is a rejected compare-and-set: nothing changes
    from orchestrator.store.children import Done

    assert orc.store.children.complete(Done(d.run_id, "kid", 1, 1, child.id, "SUCCEEDED"), 100) == []
    assert [e.accepted for e in orc.ledger(d.run_id) if e.key == "kid" and e.to_state == "SUCCEEDED"] == [True, False]
    assert check_runs(orc.store, [d.run_id, child.id]) == []


def test_a_failed_child_starts_a_new_child_on_the_next_attempt_then_fails_the_node(orc: Orchestrator) -> None:
    d = drive(orc, parent_dag(child_dag(fail=True), max_attempts=2), body)
    run_all(orc, d.run_id)
    first, second = children(orc, d.run_id)
    assert (first.parent_attempt, first.state, second.parent_attempt, second.state) == (1, "FAILED", 2, "FAILED")
    assert second.idempotency_key == f"child:{d.run_id}:kid:2"
    kid = orc.task(d.run_id, "kid")
    assert (kid.state.value, kid.attempt) == ("FAILED", 2)
    assert kid.error == f"ChildRunFailed: child run {second.id} FAILED"
    assert d.states() == {"a": "SUCCEEDED", "kid": "FAILED", "b": "UPSTREAM_FAILED"}
    assert d.run_state() == "FAILED"
    moves = [(e.from_state, e.to_state, e.attempt) for e in orc.ledger(d.run_id) if e.key == "kid" and not e.kind]
    assert moves == [("PENDING", "WAITING", 1), ("WAITING", "WAITING", 1), ("WAITING", "FAILED", 2)]


def test_wait_false_succeeds_once_the_child_is_stored(orc: Orchestrator) -> None:
    d = drive(orc, parent_dag(child_dag(), wait=False), body)
    assert orc.children.tick() == 1
    (child,) = children(orc, d.run_id)
    assert orc.task(d.run_id, "kid").result == {"run_id": child.id}
    drive(orc, DAG("x"), body, run_id=d.run_id)
    assert d.run_state() == "SUCCEEDED" and orc.run_state(child.id).value == "RUNNING"
    orc.children.tick()  # the child is no orphan: its node let it go on purpose
    assert orc.run_state(child.id).value == "RUNNING"


@pytest.mark.parametrize("policy", ["cancel", "abandon"])
def test_a_cancel_of_the_parent_acts_on_the_child_by_its_policy(orc: Orchestrator, policy: str) -> None:
    d = drive(orc, parent_dag(child_dag(), on_parent_end=policy), body)
    orc.children.tick()
    (child,) = children(orc, d.run_id)
    orc.cancel(d.run_id)
    assert d.states()["kid"] == "CANCELLED"
    orc.children.tick()
    want = "CANCELLED" if policy == "cancel" else "RUNNING"
    assert orc.run_state(child.id).value == want
    notes = annotations(orc, d.run_id, "kid")
    assert (f"cancelled child run {child.id} (on_parent_end=cancel)" in notes) == (policy == "cancel")
    orc.children.tick()  # a second pass changes nothing
    assert len(children(orc, d.run_id)) == 1


@pytest.mark.parametrize("policy", ["cancel", "abandon"])
def test_a_clear_of_the_parent_node_acts_on_the_old_child_and_starts_a_new_one(orc: Orchestrator, policy: str) -> None:
    d = drive(orc, parent_dag(child_dag(), on_parent_end=policy), body)
    orc.children.tick()
    (old,) = children(orc, d.run_id)
    orc.clear(d.run_id, "kid")
    kid = task_row(orc, d.run_id, "kid")
    assert (kid.state, kid.attempt) == ("WAITING", 2)
    orc.children.tick()
    old_state, new = orc.run_state(old.id).value, children(orc, d.run_id)[-1]
    assert old_state == ("CANCELLED" if policy == "cancel" else "RUNNING")
    assert new.id != old.id and new.parent_attempt == 2
    assert task_row(orc, d.run_id, "kid").child_run_id == new.id
    run_all(orc, d.run_id)
    assert d.run_state() == "SUCCEEDED"
    # the old child, abandoned and finished late, does not end the node's new attempt
    assert [e.reason for e in orc.ledger(d.run_id) if e.key == "kid" and e.to_state == "SUCCEEDED"] == [
        f"child run {new.id} SUCCEEDED"
    ]


def test_a_start_for_a_node_that_moved_on_is_rolled_back_whole(orc: Orchestrator) -> None:
    d = drive(orc, parent_dag(child_dag()), body)
    (pending,) = orc.store.children.to_start()
    orc.cancel(d.run_id)
    assert orc.children.start(pending) is False
    assert children(orc, d.run_id) == []
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(s.runs)).scalar_one() == 1


def test_a_registered_dag_by_name_and_version(orc: Orchestrator) -> None:
    orc.register(child_dag())
    d = drive(orc, parent_dag("etl@1"), body)
    orc.children.tick()
    (child,) = children(orc, d.run_id)
    assert (child.dag_name, child.dag_version) == ("etl", 1)
    assert annotations(orc, d.run_id, "kid") == [f"started child run {child.id} (etl@1)"]
    run_all(orc, d.run_id)
    assert d.run_state() == "SUCCEEDED"


def test_a_bad_dag_is_refused(orc: Orchestrator) -> None:
    with pytest.raises(ValidationError, match=r"run_dag: .*etl"):
        orc.submit(parent_dag("etl"))  # an unknown registered name: at submit
    orc.register(child_dag())
    with pytest.raises(ValidationError, match="run_dag"):
        orc.submit(parent_dag("etl@7"))
    dag = DAG("p")
    with pytest.raises(ValidationError, match="on_parent_end"):
        dag.run_dag("kid", dag="etl", on_parent_end="orphan")
    with pytest.raises(ValidationError, match="registered DAG's name"):
        dag.run_dag("kid2", dag=42)
    with pytest.raises(ValidationError, match="NAME or NAME@VERSION"):
        dag.run_dag("kid3", dag="etl@x")
    with pytest.raises(ValidationError, match="params"):
        dag.run_dag("kid4", dag="etl", params=["not", "a", "mapping"])
    bad_spec = {"name": "inline", "nodes": [{"key": "x", "task": "no.such.task"}]}
    with pytest.raises(ValidationError, match="run_dag"):
        orc.submit(parent_dag(bad_spec))
    assert orc.runs() == []


def test_the_spec_format_round_trips(orc: Orchestrator) -> None:
    spec = parent_dag(child_dag(), on_parent_end="abandon").to_spec()
    kid = next(n for n in spec["nodes"] if n["key"] == "kid")
    assert kid["task"] == "orchestrator.run_dag" and kid["run_dag"]["on_parent_end"] == "abandon"
    assert kid["run_dag"]["dag"]["name"] == "etl" and kid["run_dag"]["params"] == {"day": "2026-11-29"}
    again = dag_from_spec(spec)
    assert again.to_spec() == spec
    by_name = {"name": "p", "nodes": [{"key": "kid", "run_dag": {"dag": "etl@2", "wait": False}}]}
    node = dag_from_spec(by_name).nodes["kid"]
    assert node.child is not None and (node.child.name, node.child.version, node.child.wait) == ("etl", 2, False)


def test_a_root_child_node_waits_from_the_submit(orc: Orchestrator) -> None:
    dag = DAG("rooted")
    dag.run_dag("kid", dag=child_dag())
    run = orc.submit(dag)
    assert orc.task(run.id, "kid").state.value == "WAITING"
    run_all(orc, run.id)
    assert orc.run_state(run.id).value == "SUCCEEDED"
    assert orc.task(run.id, "kid").result == {"load": {"key": "load", "upstream": ["extract"]}}


def test_a_retry_of_a_failed_child_run_node_waits_for_a_new_child(orc: Orchestrator) -> None:
    d = drive(orc, parent_dag(child_dag(fail=True)), body)
    run_all(orc, d.run_id)
    assert d.states()["kid"] == "FAILED" and d.run_state() == "FAILED"
    orc.retry_task(d.run_id, "kid")  # a clear: it waits again, on no worker
    kid = task_row(orc, d.run_id, "kid")
    assert (kid.state, kid.attempt) == ("WAITING", 2)
    orc.children.tick()
    assert [(c.parent_attempt, c.state) for c in children(orc, d.run_id)] == [(1, "FAILED"), (2, "RUNNING")]
