"""The command line of events, signals, approvals and event triggers on one database:
``orchestrator emit``, ``signal``, ``approve`` / ``reject``, ``on add|apply|list|show|pause|resume|remove``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orchestrator import DAG, Orchestrator
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.store import schema as s
from tests.store.dynamic import orchestrator

pytestmark = pytest.mark.postgres

SPEC = """name: etl
params: {region: eu}
nodes:
  - {key: extract, task: t}
  - {key: load, task: t, upstream: [extract]}
"""


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


@pytest.fixture
def use_cli(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    return CliRunner()


def waiting_dag() -> DAG:
    dag = DAG("gate")
    dag.wait("go", event="go")
    dag.approval("ok")
    dag.task("after", "t", upstream=["go", "ok"])
    return dag


def test_emit_prints_what_it_woke_and_refuses_bad_input(use_cli: CliRunner, orc: Orchestrator) -> None:
    run = orc.submit(waiting_dag())
    assert orc.task(run.id, "go").state.value == "WAITING"
    out = use_cli.invoke(cli.main, ["emit", "go", "--payload", '{"n": 1}', "--event-id", "e1"])
    assert out.exit_code == 0 and out.stdout.strip() == "event e1: woke 1 task(s)", out.output
    again = use_cli.invoke(cli.main, ["emit", "go", "--payload", '{"n": 1}', "--event-id", "e1", "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout) == {
        "id": json.loads(again.stdout)["id"], "event_id": "e1", "duplicate": True, "woken": 0,
    }  # fmt: skip
    twice = use_cli.invoke(cli.main, ["emit", "go", "--payload", '{"n": 1}', "--event-id", "e1"])
    assert twice.stdout.strip() == "event e1: duplicate, ignored"
    for args in (["emit", "bad key!"], ["emit", "go", "--payload", "[1]"], ["emit", "go", "--payload", "{nope"]):
        bad = use_cli.invoke(cli.main, args)
        assert bad.exit_code == 2 and bad.stderr.startswith("error: "), (args, bad.output)


def test_signal_approve_and_reject(use_cli: CliRunner, orc: Orchestrator) -> None:
    run = orc.submit(waiting_dag())
    sent = use_cli.invoke(cli.main, ["signal", run.id, "go", "--payload", '{"a": 1}', "--event-id", "s1"])
    assert sent.exit_code == 0 and sent.stdout.strip() == "signal s1: woke 1 task(s)", sent.output
    assert orc.task(run.id, "go").state.value != "WAITING"
    missing = use_cli.invoke(cli.main, ["signal", "no-such-run", "go"])
    assert missing.exit_code == 2 and "error:" in missing.stderr
    not_waiting = use_cli.invoke(cli.main, ["approve", run.id, "go"])
    assert not_waiting.exit_code == 2 and "not waiting for an approval" in not_waiting.stderr
    ok = use_cli.invoke(cli.main, ["approve", run.id, "ok", "--comment", "fine"])
    assert ok.exit_code == 0 and ok.stdout.strip() == f"{run.id}.ok approved", ok.output
    assert orc.task(run.id, "ok").state.value == "SUCCEEDED"
    assert orc.task(run.id, "ok").result["comment"] == "fine"
    assert "(cli)" in orc.task(run.id, "ok").result["by"]

    other = orc.submit(waiting_dag())
    no = use_cli.invoke(cli.main, ["reject", other.id, "ok"])
    assert no.exit_code == 0 and no.stdout.strip() == f"{other.id}.ok rejected"
    assert orc.task(other.id, "ok").state.value == "FAILED"
    twice = use_cli.invoke(cli.main, ["reject", other.id, "ok"])
    assert twice.exit_code == 2 and "not waiting for an approval" in twice.stderr


def test_on_add_list_show_pause_resume_remove(use_cli: CliRunner, orc: Orchestrator, tmp_path: Path) -> None:
    spec = tmp_path / "etl.yaml"
    spec.write_text(SPEC)
    added = use_cli.invoke(
        cli.main,
        ["on", "add", "orders", "--event", "orders.new", "--match", '{"kind": "big"}', "--spec", str(spec),
         "--params", '{"n": 1}', "--max-active-runs", "2"],
    )  # fmt: skip
    assert added.exit_code == 0 and added.stdout.startswith("trigger orders: on orders.new, spec etl"), added.output
    as_dag = use_cli.invoke(cli.main, ["on", "add", "by-dag", "--event", "orders.new", "--dag", str(spec)])
    assert as_dag.exit_code == 0 and "spec etl" in as_dag.stdout, as_dag.output  # --dag FACTORY|SPEC
    assert use_cli.invoke(cli.main, ["on", "remove", "by-dag"]).exit_code == 0
    refused = use_cli.invoke(
        cli.main, ["on", "add", "bad", "--event", "orders.new", "--match", "[1]", "--spec", str(spec)]
    )
    assert refused.exit_code == 2 and "--match must be a JSON object" in refused.stderr
    neither = use_cli.invoke(cli.main, ["on", "add", "bad", "--event", "orders.new"])
    assert neither.exit_code == 2 and "one of them" in neither.stderr
    with orc.store.engine.connect() as conn:
        assert [r.name for r in conn.execute(sa.select(s.triggers)).all()] == ["orders"]

    emitted = use_cli.invoke(
        cli.main, ["emit", "orders.new", "--payload", '{"kind": "big", "id": 9}', "--event-id", "o9"]
    )
    assert emitted.exit_code == 0, emitted.output
    use_cli.invoke(cli.main, ["emit", "orders.new", "--payload", '{"kind": "small"}'])

    listed = use_cli.invoke(cli.main, ["on", "list"])
    assert listed.exit_code == 0 and listed.stdout.startswith('orders  on orders.new match {"kind": "big"}')
    assert "active" in listed.stdout and "last " in listed.stdout
    as_json = json.loads(use_cli.invoke(cli.main, ["on", "list", "--json"]).stdout)["triggers"]
    assert [t["name"] for t in as_json] == ["orders"] and as_json[0]["max_active_runs"] == 2

    shown = json.loads(use_cli.invoke(cli.main, ["on", "show", "orders", "--json"]).stdout)
    assert shown["trigger"]["params"] == {"n": 1}
    assert [(f["event_id"], f["state"]) for f in shown["firings"]] == [("o9", "fired")]
    run_id = shown["firings"][0]["run_id"]
    with orc.store.engine.connect() as conn:
        ran = conn.execute(sa.select(s.runs).where(s.runs.c.id == run_id)).one()
    assert (ran.trigger, ran.params) == ("orders", {"region": "eu", "n": 1, "kind": "big", "id": 9})
    text = use_cli.invoke(cli.main, ["on", "show", "orders"]).stdout
    assert "event:            orders.new" in text and "o9  fired" in text

    assert use_cli.invoke(cli.main, ["on", "pause", "orders"]).stdout.strip() == "trigger orders paused"
    assert "paused" in use_cli.invoke(cli.main, ["on", "list"]).stdout
    assert use_cli.invoke(cli.main, ["on", "resume", "orders"]).stdout.strip() == "trigger orders resumed"
    assert use_cli.invoke(cli.main, ["on", "remove", "orders"]).stdout.strip() == "trigger orders removed"
    gone = use_cli.invoke(cli.main, ["on", "show", "orders"])
    assert gone.exit_code == 2 and "no trigger named 'orders'" in gone.stderr


def test_on_apply_checks_every_entry_first(use_cli: CliRunner, orc: Orchestrator, tmp_path: Path) -> None:
    (tmp_path / "etl.yaml").write_text(SPEC)
    good = tmp_path / "triggers.yaml"
    good.write_text(
        "triggers:\n"
        "  - {name: a, event: orders.new, spec: etl.yaml}\n"
        "  - {name: b, event: orders.paid, spec: etl.yaml, match: {currency: EUR}, paused: true}\n"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "triggers:\n  - {name: c, event: orders.new, spec: etl.yaml}\n  - {name: d, event: orders.new, when: now}\n"
    )
    refused = use_cli.invoke(cli.main, ["on", "apply", str(bad)])
    assert refused.exit_code == 2 and "unknown field" in refused.stderr
    assert orc.triggers.all() == []
    applied = use_cli.invoke(cli.main, ["on", "apply", str(good)])
    assert applied.exit_code == 0 and applied.stdout.splitlines() == [
        "trigger a: on orders.new, " + orc.triggers.get("a").what,
        "trigger b: on orders.paid, " + orc.triggers.get("b").what,
    ], applied.output
    assert orc.triggers.get("b").paused and orc.triggers.get("b").match == {"currency": "EUR"}
