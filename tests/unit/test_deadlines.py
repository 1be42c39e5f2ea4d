"""Deadlines at the edges: the DAG's and the nodes' ``deadline`` and ``on_deadline`` are
checked (typed ValidationError naming the DAG, node and field) before anything is written,
from the Python API and from spec files; and a submit through the engine on SQLite is judged
by ``Orchestrator.reconcile``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState, Settings, ValidationError
from orchestrator.core.dag import MAX_DEADLINE, OnDeadline, load_spec
from orchestrator.core.errors import SpecError
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.services.invariants import check_runs
from orchestrator.store import schema as s


@pytest.fixture
def orc(tmp_path: Path, pg_clean: str) -> Iterator[Orchestrator]:
    o = Orchestrator(
        Settings.from_env({}, data_dir=str(tmp_path), database_url=pg_clean),
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t"]),
    )
    o.register_worker("w", default_queues(), 10)
    yield o
    o.store.dispose()


def rows(orc: Orchestrator) -> int:
    with orc.store.engine.connect() as conn:
        return sum(conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one() for t in (s.runs, s.tasks))


@pytest.mark.parametrize(
    ("build", "says", "node"),
    [
        (lambda: DAG("d", deadline=0), "deadline must be a number of seconds above 0 and at most 31622400", None),
        (lambda: DAG("d", deadline=-5), "deadline must be a number of seconds above 0", None),
        (lambda: DAG("d", deadline=float("nan")), "deadline must be a number of seconds above 0", None),
        (lambda: DAG("d", deadline=float("inf")), "deadline must be a number of seconds above 0", None),
        (lambda: DAG("d", deadline=MAX_DEADLINE + 1), "at most 31622400, not 31622401", None),
        (lambda: DAG("d", deadline=True), "not True", None),
        (lambda: DAG("d", deadline="600"), "not '600'", None),
        (lambda: DAG("d", on_deadline="cancel"), "on_deadline 'cancel' needs a deadline", None),
        (lambda: _node(deadline=0.0), "deadline must be a number of seconds above 0", "a"),
        (lambda: _node(deadline=10**9), "at most 31622400", "a"),
        (lambda: _node(deadline=[1]), r"not \[1\]", "a"),
    ],
)
def test_bad_deadlines_are_refused_before_anything_is_written(
    orc: Orchestrator, build: Any, says: str, node: str | None
) -> None:
    dag = build()
    if not dag.nodes:
        dag.task("a", "t")
    before = rows(orc)
    with pytest.raises(ValidationError, match=says) as info:
        orc.submit(dag)
    assert (info.value.dag, info.value.node) == ("d", node)  # type: ignore[attr-defined]
    assert rows(orc) == before


def _node(**kwargs: Any) -> DAG:
    dag = DAG("d")
    dag.task("a", "t", **kwargs)
    return dag


def test_an_unknown_on_deadline_is_refused_at_once() -> None:
    with pytest.raises(ValidationError, match=r"unknown on_deadline 'kill' \(one of: alert, cancel\)"):
        DAG("d", deadline=5, on_deadline="kill")


def test_good_deadlines_are_accepted(orc: Orchestrator) -> None:
    dag = DAG("d", deadline=0.5, on_deadline=OnDeadline.CANCEL)
    dag.task("a", "t", deadline=MAX_DEADLINE)
    dag.task("b", "t", deadline=1)
    run = orc.submit(dag)
    with orc.store.engine.connect() as conn:
        run_row = conn.execute(sa.select(s.runs).where(s.runs.c.id == run.id)).one()
        task_rows = conn.execute(sa.select(s.tasks).where(s.tasks.c.run_id == run.id).order_by(s.tasks.c.key)).all()
    assert (run_row.deadline_seconds, run_row.on_deadline) == (0.5, "cancel")
    assert [t.deadline_seconds for t in task_rows] == [MAX_DEADLINE, 1.0]
    created = run_row.created_at
    assert round((run_row.deadline_at - created).total_seconds(), 3) == 0.5
    assert round((task_rows[1].deadline_at - created).total_seconds(), 3) == 1.0
    assert run_row.dag_snapshot["deadline"] == 0.5 and run_row.dag_snapshot["on_deadline"] == "cancel"


def test_a_dag_without_deadlines_stores_none(orc: Orchestrator) -> None:
    dag = DAG("plain")
    dag.task("a", "t")
    run = orc.submit(dag)
    with orc.store.engine.connect() as conn:
        r = conn.execute(sa.select(s.runs).where(s.runs.c.id == run.id)).one()
        t = conn.execute(sa.select(s.tasks).where(s.tasks.c.run_id == run.id)).one()
    assert (r.deadline_seconds, r.deadline_at, r.on_deadline) == (None, None, None)
    assert (t.deadline_seconds, t.deadline_at) == (None, None)


@pytest.mark.parametrize(
    ("logical_date", "due"),
    [
        ("2026-11-23", "2026-11-23 00:10:00+00:00"),  # a bare date: its midnight, UTC
        ("2026-11-23T12:00:00", "2026-11-23 12:10:00+00:00"),  # no zone: UTC
        ("2026-11-23T12:00:00+02:00", "2026-11-23 10:10:00+00:00"),
        ("2026-11-23T12:00:00Z", "2026-11-23 12:10:00+00:00"),
    ],
)
def test_deadlines_count_from_the_logical_date(orc: Orchestrator, logical_date: str, due: str) -> None:
    dag = DAG("d", deadline=600)
    dag.task("a", "t", deadline=600)
    run = orc.submit(dag, logical_date=logical_date)
    with orc.store.engine.connect() as conn:
        run_due = conn.execute(sa.select(s.runs.c.deadline_at).where(s.runs.c.id == run.id)).scalar_one()
        task_due = conn.execute(sa.select(s.tasks.c.deadline_at).where(s.tasks.c.run_id == run.id)).scalar_one()
    assert str(run_due.replace(tzinfo=None)) + "+00:00" == due == str(task_due.replace(tzinfo=None)) + "+00:00"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"deadline": 0}, "deadline must be a number of seconds above 0"),
        ({"deadline": "10m"}, "'deadline' must be a number of seconds"),
        ({"on_deadline": "cancel"}, "on_deadline 'cancel' needs a deadline"),
        ({"on_deadline": "pause", "deadline": 5}, "unknown on_deadline 'pause'"),
        ({"on_deadline": ["cancel"], "deadline": 5}, "'on_deadline' must be 'alert' or 'cancel'"),
        ({"node_deadline": -1}, "deadline must be a number of seconds above 0"),
        ({"node_deadline": "soon"}, "'deadline' must be a number of seconds"),
    ],
)
def test_spec_files_with_bad_deadlines_are_refused(
    orc: Orchestrator, tmp_path: Path, spec: dict[str, Any], says: str
) -> None:
    node: dict[str, Any] = {"key": "a", "task": "t"}
    if "node_deadline" in spec:
        node["deadline"] = spec.pop("node_deadline")
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"name": "d", **spec, "nodes": [node]}))
    before = rows(orc)
    with pytest.raises(ValidationError, match=says):
        orc.submit(load_spec(path))
    assert rows(orc) == before


def test_a_spec_file_with_deadlines(orc: Orchestrator, tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(
        "name: nightly\ndeadline: 600\non_deadline: alert\nnodes:\n"
        "  - {key: extract, task: t, deadline: 300}\n  - {key: load, task: t, upstream: [extract], deadline: null}\n"
    )
    dag = load_spec(path)
    assert (dag.deadline, dag.on_deadline, dag.nodes["extract"].deadline, dag.nodes["load"].deadline) == (
        600,
        OnDeadline.ALERT,
        300,
        None,
    )
    with pytest.raises(SpecError, match="'deadline' must be a number"):
        path.write_text("name: x\nnodes:\n  - {key: a, task: t, deadline: [1]}\n")
        load_spec(path)


def test_the_engine_reconciles_a_missed_deadline(orc: Orchestrator) -> None:
    dag = DAG("late", deadline=60, on_deadline="cancel")
    dag.task("a", "t")
    run = orc.submit(dag, logical_date="2020-01-01")
    report = orc.reconcile()
    assert (report["deadlines_missed"], report["deadline_cancels"]) == (1, 1)
    assert run.state is RunState.CANCELLED
    publisher = orc.publisher
    assert isinstance(publisher, RecordingPublisher) and publisher.revoked == [f"{run.id}.a.1"]
    last = run.events()[-1]
    assert (last.key, last.from_state, last.to_state, last.actor) == (None, "CANCELLED", "CANCELLED", "reconciler")
    assert (last.reason or "").startswith("deadline missed: run deadline 60s (due 2020-01-01T00:01:00Z)")
    assert orc.reconcile()["deadlines_missed"] == 0
    assert check_runs(orc.store, [run.id]) == []
