"""Defects a newcomer hit (issue 17), on Postgres: a conflicting idempotent submit is refused
with a typed error naming the run it conflicts with; Celery signature options are honoured or
refused, never dropped; operator refusals read "skip of" / "fail of"; ``schedule show`` prints
text unless asked for JSON; ``status --json`` carries the run's logical date and schedule."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import DAG, ConflictError, IdempotencyConflict, Orchestrator, Priority, Settings, ValidationError
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from tests.conftest import empty_tables

TASKS = ["t.ok", "t.other", "tasks.probes.echo"]


@pytest.fixture
def orc(pg_url: str, tmp_path: Path) -> Iterator[Orchestrator]:
    settings = Settings.from_env({}, data_dir=str(tmp_path), database_url=pg_url)
    o = Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(TASKS))
    empty_tables(o.store.engine)
    yield o
    o.store.dispose()


@pytest.fixture
def use_cli(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """The CLI acting on ``orc`` (the test Postgres database, its static registry)."""
    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    return CliRunner()


def two_nodes(name: str = "daily", *, params: dict[str, object] | None = None, task: str = "t.ok") -> DAG:
    dag = DAG(name, tenant="acme", params=params)
    a = dag.task("a", "t.ok", kwargs={"day": "2026-04-25"})
    dag.task("b", task, upstream=[a])
    return dag


# ---------------------------------------------------------------- idempotency key conflicts


def test_the_same_key_with_the_same_dag_returns_the_same_run(orc: Orchestrator) -> None:
    first = orc.submit(two_nodes(params={"n": 1, "x": [1.5, "y"]}), idempotency_key="k1")
    again = orc.submit(two_nodes(params={"x": [1.5, "y"], "n": 1}), idempotency_key="k1")
    assert again.id == first.id
    # the same nodes added in another order are the same body
    other_order = DAG("daily", tenant="acme", params={"n": 1, "x": [1.5, "y"]})
    other_order.task("b", "t.ok", upstream=["a"])
    other_order.task("a", "t.ok", kwargs={"day": "2026-04-25"})
    assert orc.submit(other_order, idempotency_key="k1").id == first.id
    assert len(orc.runs()) == 1


def test_the_same_key_with_other_params_is_refused_naming_the_run(orc: Orchestrator) -> None:
    first = orc.submit(two_nodes(params={"n": 1}), idempotency_key="k1")
    with pytest.raises(IdempotencyConflict) as info:
        orc.submit(two_nodes(params={"n": 2}), idempotency_key="k1")
    assert isinstance(info.value, ValidationError)
    assert info.value.run_id == first.id and info.value.idempotency_key == "k1"
    assert first.id in str(info.value) and "params" in str(info.value)
    assert [r.id for r in orc.runs()] == [first.id]  # nothing written


def test_the_same_key_with_another_body_is_refused(orc: Orchestrator) -> None:
    first = orc.submit(two_nodes(), idempotency_key="k1")
    with pytest.raises(IdempotencyConflict, match=f"run {first.id} with another DAG body"):
        orc.submit(two_nodes(task="t.other"), idempotency_key="k1")
    with pytest.raises(IdempotencyConflict):
        changed = two_nodes()
        changed.task("c", "t.ok", upstream=["b"])
        orc.submit(changed, idempotency_key="k1")
    # another DAG name or another tenant is another key space
    assert orc.submit(two_nodes("weekly", task="t.other"), idempotency_key="k1").id != first.id
    assert len(orc.runs()) == 2


def test_cli_submit_with_a_conflicting_key_exits_2_naming_the_run(
    orc: Orchestrator, use_cli: CliRunner, tmp_path: Path
) -> None:
    spec = tmp_path / "daily.yaml"
    spec.write_text("name: daily\nparams: {n: 1}\nnodes:\n  - {key: a, task: t.ok}\n")
    done = use_cli.invoke(cli.main, ["submit", str(spec), "--idempotency-key", "k1"])
    assert done.exit_code == 0, done.output
    run_id = done.output.strip()
    again = use_cli.invoke(cli.main, ["submit", str(spec), "--idempotency-key", "k1"])
    assert again.exit_code == 0 and again.output.strip() == run_id
    spec.write_text("name: daily\nparams: {n: 2}\nnodes:\n  - {key: a, task: t.ok}\n")
    conflict = use_cli.invoke(cli.main, ["submit", str(spec), "--idempotency-key", "k1"])
    assert conflict.exit_code == 2, conflict.output
    assert "error:" in conflict.output and run_id in conflict.output and "idempotency key 'k1'" in conflict.output


# ---------------------------------------------------------------- signature options


def test_signature_queue_priority_and_time_limits_become_the_nodes(orc: Orchestrator) -> None:
    from tasks.probes import echo

    dag = DAG("sig")
    sig = echo.s(1).set(queue="custom.q", priority="high", soft_time_limit=10, time_limit=20, ignore_result=True)
    node = dag.task("a", sig)
    assert (node.queue, node.priority, node.soft_time_limit, node.time_limit) == ("custom.q", Priority.HIGH, 10, 20)
    assert dag.task("b", echo.si(2).set(queue="custom.q"), queue="custom.q").queue == "custom.q"
    orc.register_worker("w", ["custom.q"], 10)
    run = orc.submit(dag)
    (task,) = [t for t in run.tasks() if t.key == "a"]
    assert (task.queue, task.priority) == ("custom.q", "high")
    (sent,) = [d for d in orc.publisher.take() if d.key == "a"]  # type: ignore[attr-defined]
    assert (sent.queue, sent.soft_time_limit, sent.time_limit) == ("custom.q", 10, 20)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"countdown": 30}, "'countdown'"),
        ({"eta": "2026-04-25T00:00:00"}, "'eta'"),
        ({"expires": 60}, "'expires'"),
        ({"task_id": "mine"}, "'task_id'"),
        ({"headers": {"x": 1}}, "'headers'"),
        ({"routing_key": "r"}, "'routing_key'"),
        ({"serializer": "pickle"}, "serializer='pickle'"),
        ({"whatever": 1}, "'whatever'"),
        ({"queue": "custom.q", "priority": 9, "countdown": 30}, "priority=9"),
    ],
)
def test_signature_options_that_break_the_promise_are_refused(options: dict[str, object], named: str) -> None:
    from tasks.probes import echo

    with pytest.raises(ValidationError, match="node 'a'") as info:
        DAG("sig").task("a", echo.s(1).set(**options))
    assert named in str(info.value)


def test_callbacks_and_canvas_parts_are_refused() -> None:
    from celery import chord, group

    from tasks.probes import echo

    for task, named in (
        (echo.s(1).on_error(echo.s()), "'link_error'"),
        (echo.s(1).set(link=echo.s()), "'link'"),
        (echo.s(1) | echo.s(), "chain"),
        (group(echo.s(1), echo.s(2)), "group"),
        (chord([echo.s(1)], echo.s()), "chord"),
    ):
        with pytest.raises(ValidationError, match="node 'a'") as info:
            DAG("sig").task("a", task)
        assert named in str(info.value)


def test_a_signature_option_contradicting_the_keyword_is_refused() -> None:
    from tasks.probes import echo

    with pytest.raises(ValidationError, match="queue is set twice"):
        DAG("sig").task("a", echo.s(1).set(queue="one"), queue="two")
    with pytest.raises(ValidationError, match="unknown signature option priority 'urgent'"):
        DAG("sig").task("a", echo.s(1).set(priority="urgent"))


# ---------------------------------------------------------------- operator messages


def test_operator_refusals_name_the_action(orc: Orchestrator) -> None:
    dag = DAG("one")
    dag.task("s", "t.ok")
    run = orc.submit(dag)
    with pytest.raises(ConflictError, match=rf"^skip of {run.id}\.s refused: "):
        orc.skip_task(run.id, "s")
    with pytest.raises(ConflictError, match=rf"^fail of {run.id}\.s refused: "):
        orc.fail_task(run.id, "s")
    with pytest.raises(ConflictError, match=rf"^retry of {run.id}\.s refused: "):
        orc.retry_task(run.id, "s")


# ---------------------------------------------------------------- schedule show, status --json


def test_schedule_show_prints_text_or_json(orc: Orchestrator, use_cli: CliRunner) -> None:
    dag = DAG("nightly")
    dag.task("a", "t.ok")
    orc.schedules.add("nightly", cron="0 3 * * *", spec=dag, params={"n": 1})
    fired = orc.schedules.trigger("nightly")
    assert fired.run_id is not None
    text = use_cli.invoke(cli.main, ["schedule", "show", "nightly"])
    assert text.exit_code == 0, text.output
    assert "{" not in text.output.splitlines()[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.output)
    assert "name:" in text.output and "nightly" in text.output and "0 3 * * *" in text.output
    assert fired.run_id in text.output
    as_json = use_cli.invoke(cli.main, ["schedule", "show", "nightly", "--json"])
    assert as_json.exit_code == 0, as_json.output
    shown = json.loads(as_json.output)
    assert shown["schedule"]["name"] == "nightly" and shown["firings"][0]["run_id"] == fired.run_id


def test_status_json_has_the_logical_date_and_the_schedule(orc: Orchestrator, use_cli: CliRunner) -> None:
    dag = DAG("nightly")
    dag.task("a", "t.ok")
    orc.schedules.add("nightly", cron="0 3 * * *", spec=dag)
    fired = orc.schedules.trigger("nightly")
    assert fired.run_id is not None
    done = use_cli.invoke(cli.main, ["status", fired.run_id, "--json"])
    assert done.exit_code == 0, done.output
    run = json.loads(done.output)["run"]
    assert run["schedule"] == "nightly"
    assert run["logical_date"] is not None
    assert abs((fired.logical_date - dt.datetime.fromisoformat(run["logical_date"])).total_seconds()) < 0.001
    text = use_cli.invoke(cli.main, ["status", fired.run_id])
    assert "schedule nightly" in text.output and "logical date" in text.output

    plain = orc.submit(dag, logical_date="2026-04-25")
    run = json.loads(use_cli.invoke(cli.main, ["status", plain.id, "--json"]).output)["run"]
    assert (run["logical_date"], run["schedule"]) == ("2026-04-25", None)
    bare = DAG("bare")
    bare.task("a", "t.ok")
    run = json.loads(use_cli.invoke(cli.main, ["status", orc.submit(bare).id, "--json"]).output)["run"]
    assert (run["logical_date"], run["schedule"]) == (None, None)
