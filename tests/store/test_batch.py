"""Keyed flow control's ``batch`` on one database (issue 34): ``submit(..., concurrency_key=K,
batch=(N, window))`` and an event trigger's ``batch``: the first submission of a key opens a held
run, the next ones are merged into its ``events`` param (each merged run CANCELLED with a ledger
row naming the run), the flow pass releases it when it holds N events or its window is over;
bad options are refused before anything is written; keys are per tenant."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orchestrator import DAG, Orchestrator
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.core.flow import FlowControlError
from orchestrator.engine.flow import release
from orchestrator.services.triggers import TriggerError
from orchestrator.store import schema as s
from tests.store.dynamic import drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def pipeline(tenant: str | None = None, **params: Any) -> DAG:
    dag = DAG("gather", params=params, **({"tenant": tenant} if tenant else {}))
    dag.task("extract", "t")
    return dag


def run(orc: Orchestrator, run_id: str) -> Any:
    with orc.store.engine.connect() as conn:
        return conn.execute(sa.select(s.runs).where(s.runs.c.id == run_id)).one()


def ledger(orc: Orchestrator, run_id: str) -> list[tuple[Any, ...]]:
    e = s.events.c
    with orc.store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(e.kind, e.to_state, e.reason).where(e.run_id == run_id, e.key.is_(None)).order_by(e.id)
        ).all()
    return [tuple(r) for r in rows]


def count(orc: Orchestrator, table: sa.Table) -> int:
    with orc.store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def submit(orc: Orchestrator, n: int, *, key: str = "k", batch: Any = (3, "1h"), tenant: str | None = None) -> str:
    return orc.submit(pipeline(tenant, events=[{"n": n}]), concurrency_key=key, batch=batch).id


def test_a_batch_of_n_closes_at_n_and_each_merge_is_a_ledger_row(orc: Orchestrator) -> None:
    ids = [submit(orc, n) for n in range(7)]
    first, second, third = ids[0], ids[3], ids[6]
    assert [orc.run_state(i).value for i in ids] == ["RUNNING", "CANCELLED", "CANCELLED"] * 2 + ["RUNNING"]
    assert run(orc, first).params["events"] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert run(orc, first).dag_snapshot["params"]["events"] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert run(orc, second).params["events"] == [{"n": 3}, {"n": 4}, {"n": 5}]
    assert run(orc, third).params["events"] == [{"n": 6}]
    assert (None, "CANCELLED", f"merged into run {first} (batch on key k: 2 of 3 events)") in ledger(orc, ids[1])
    assert (None, "CANCELLED", f"merged into run {first} (batch on key k: 3 of 3 events)") in ledger(orc, ids[2])
    assert any(r[0] == "held" and r[2].startswith("batching until ") for r in ledger(orc, first))
    assert orc.explain(third)[0].reasons[0].detail.startswith("batching until ")
    assert release(orc) == 2  # the two full batches; the third waits for its hour
    assert run(orc, first).held is None and run(orc, second).held is None and run(orc, third).held == "batch"
    assert drive(orc, pipeline(), run_id=first).run_state() == "SUCCEEDED"


def test_the_window_closes_a_smaller_batch(orc: Orchestrator) -> None:
    ids = [submit(orc, n, batch=(100, "5s")) for n in range(2)]
    assert release(orc) == 0
    with orc.store.engine.begin() as conn:  # the window since the first event is over
        conn.execute(sa.text("UPDATE orc_runs SET held_until = held_until - interval '1 minute'"))
    assert release(orc) == 1
    assert run(orc, ids[0]).held is None and run(orc, ids[0]).params["events"] == [{"n": 0}, {"n": 1}]
    later = submit(orc, 2, batch=(100, "5s"))  # the released batch takes nothing more: a new one opens
    assert run(orc, later).held == "batch" and run(orc, later).params["events"] == [{"n": 2}]


def test_a_submission_without_an_events_list_is_one_event(orc: Orchestrator) -> None:
    a = orc.submit(pipeline(x=1), concurrency_key="k", batch=(5, 60)).id
    orc.submit(pipeline(x=2), concurrency_key="k", batch=(5, 60))
    assert run(orc, a).params["events"] == [{"x": 1}, {"x": 2}]


def test_batches_are_per_tenant(orc: Orchestrator) -> None:
    a = submit(orc, 1, tenant="a")
    b = submit(orc, 2, tenant="b")
    assert run(orc, a).held == "batch" and run(orc, b).held == "batch"
    submit(orc, 3, tenant="a")
    assert run(orc, a).params["events"] == [{"n": 1}, {"n": 3}] and run(orc, b).params["events"] == [{"n": 2}]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"concurrency_key": "k", "batch": 100}, "batch 100"),
        ({"concurrency_key": "k", "batch": (0, "5s")}, "batch size"),
        ({"concurrency_key": "k", "batch": (100, "soon")}, "batch window"),
        ({"concurrency_key": "k", "batch": (10, 5), "debounce": 3}, "not with debounce"),
        ({"concurrency_key": "k", "batch": (10, 5), "on_busy": "skip"}, "on_busy"),
        ({"batch": (10, 5)}, "needs a concurrency_key"),
    ],
)
def test_bad_batch_options_are_refused_before_anything_is_written(
    orc: Orchestrator, options: dict[str, Any], words: str
) -> None:
    before = count(orc, s.runs)
    with pytest.raises(FlowControlError, match=words):
        orc.submit(pipeline(), **options)
    assert count(orc, s.runs) == before


def test_a_trigger_gathers_its_events_into_batched_runs(orc: Orchestrator) -> None:
    found = orc.triggers.add("gather", event="orders.new", spec=pipeline(), params={"region": "eu"}, batch=(2, "1h"))
    assert found.batch == (2, 3600.0) and found.to_json()["batch"] == [2, 3600.0]
    for n in range(5):
        orc.events.emit("orders.new", {"order": n}, event_id=f"e{n}")
    with orc.store.engine.connect() as conn:
        runs = conn.execute(sa.select(s.runs).where(s.runs.c.trigger == "gather").order_by(s.runs.c.created_at)).all()
    kept = [r for r in runs if r.state == "RUNNING"]
    assert [r.params["events"] for r in kept] == [
        [{"order": 0}, {"order": 1}],
        [{"order": 2}, {"order": 3}],
        [{"order": 4}],
    ]
    assert all(r.params["region"] == "eu" and r.flow_key == "trigger:gather" for r in kept)
    assert len(runs) == 5 and sum(r.state == "CANCELLED" for r in runs) == 2
    assert release(orc) == 2


@pytest.mark.parametrize(
    ("batch", "words"), [((0, "5s"), "batch size"), ((5, "never"), "batch window"), ("lots", "batch 'lots'")]
)
def test_a_trigger_with_a_bad_batch_is_refused_and_nothing_written(orc: Orchestrator, batch: Any, words: str) -> None:
    with pytest.raises(TriggerError, match=words):
        orc.triggers.add("gather", event="orders.new", spec=pipeline(), batch=batch)
    assert count(orc, s.triggers) == 0
    with pytest.raises(TriggerError, match="keyed by"):
        orc.triggers.add("bad name!", event="orders.new", spec=pipeline(), batch=(5, 5))
    assert count(orc, s.triggers) == 0


def test_the_command_line_adds_a_batched_trigger(
    orc: Orchestrator, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    spec = tmp_path / "gather.yaml"
    spec.write_text("name: gather\nnodes:\n  - {key: extract, task: t}\n")
    runner = CliRunner()
    added = runner.invoke(
        cli.main, ["on", "add", "gather", "--event", "orders.new", "--spec", str(spec), "--batch", "100,5s"]
    )
    assert added.exit_code == 0, added.output
    assert orc.triggers.get("gather").batch == (100, 5.0)
    bad = runner.invoke(
        cli.main, ["on", "add", "other", "--event", "orders.new", "--spec", str(spec), "--batch", "0,5s"]
    )
    assert bad.exit_code != 0 and "batch size" in bad.output


def test_the_command_line_submits_a_batch(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    spec = tmp_path / "gather.yaml"
    spec.write_text("name: gather\nnodes:\n  - {key: extract, task: t}\n")
    runner = CliRunner()
    args = ["submit", str(spec), "--concurrency-key", "orders", "--batch", "2,1h"]
    first, second = runner.invoke(cli.main, args), runner.invoke(cli.main, args)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    opened, merged = first.output.split()[0], second.output.split()[0]
    with orc.store.engine.connect() as conn:
        rows = dict(conn.execute(sa.select(s.runs.c.id, s.runs.c.held).where(s.runs.c.id.in_([opened, merged]))).all())
    assert rows == {opened: "batch", merged: None}  # the second merged into the first (CANCELLED), the batch full
    bad = runner.invoke(cli.main, ["submit", str(spec), "--concurrency-key", "orders", "--batch", "0,5s"])
    assert bad.exit_code != 0 and "batch size" in bad.output
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(s.runs)).scalar_one() == 2
