"""The command line of tags and bulk actions on one database (issue 34): ``submit --tag``,
``runs --tag`` (with ``--state`` and ``--dag``), tags in ``status``, and ``orchestrator bulk
cancel|retry|rerun`` with its dry run, its report and its refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orchestrator import DAG, Orchestrator, RunState
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.store import schema as s
from tests.store.dynamic import Fail, drive, orchestrator

pytestmark = pytest.mark.postgres

SPEC = """name: etl
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


def etl() -> DAG:
    dag = DAG("etl")
    dag.task("extract", "t")
    dag.task("load", "t", upstream=["extract"])
    return dag


def broken(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
    if key == "extract":
        raise Fail("extract broke")
    return key


def ledger_rows(orc: Orchestrator) -> int:
    with orc.store.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(s.events)).scalar_one())


def test_submit_with_tags_then_runs_and_status_show_and_filter_them(
    use_cli: CliRunner, orc: Orchestrator, tmp_path: Path
) -> None:
    spec = tmp_path / "etl.yaml"
    spec.write_text(SPEC)
    out = use_cli.invoke(cli.main, ["submit", str(spec), "--tag", "customer=42", "--tag", "region=eu"])
    assert out.exit_code == 0, out.output
    tagged = out.stdout.strip()
    plain = use_cli.invoke(cli.main, ["submit", str(spec)]).stdout.strip()
    assert orc.visible(tagged).tags == {"customer": "42", "region": "eu"}

    status = use_cli.invoke(cli.main, ["status", tagged])
    assert status.exit_code == 0 and "tags customer=42 region=eu" in status.stdout.splitlines()[0]
    as_json = json.loads(use_cli.invoke(cli.main, ["status", tagged, "--json"]).stdout)
    assert as_json["run"]["tags"] == {"customer": "42", "region": "eu"}

    listed = use_cli.invoke(cli.main, ["runs", "--tag", "customer=42"])
    assert listed.exit_code == 0 and tagged in listed.stdout and plain not in listed.stdout
    assert listed.stdout.rstrip().endswith("customer=42 region=eu")
    both = use_cli.invoke(cli.main, ["runs", "--tag", "customer=42", "--tag", "region=eu", "--state", "RUNNING",
                                     "--dag", "etl", "--json"])  # fmt: skip
    assert [r["id"] for r in json.loads(both.stdout)["runs"]] == [tagged]
    for args in (["--state", "FAILED"], ["--dag", "other"], ["--tag", "region=us"]):
        none = use_cli.invoke(cli.main, ["runs", "--tag", "customer=42", *args, "--json"])
        assert json.loads(none.stdout)["runs"] == [], args


def test_bad_tags_are_one_line_errors_and_write_nothing(use_cli: CliRunner, orc: Orchestrator, tmp_path: Path) -> None:
    spec = tmp_path / "etl.yaml"
    spec.write_text(SPEC)
    for tag, named in (
        ("customer", "--tag takes KEY=VALUE, not 'customer'"),
        ("bad key=1", "tag key 'bad key' must be 1-64"),
        ("customer=", "tag 'customer': the value must not be empty"),
    ):
        out = use_cli.invoke(cli.main, ["submit", str(spec), "--tag", tag])
        assert out.exit_code == 2 and out.stderr.startswith("error: ") and named in out.stderr, out.output
        listed = use_cli.invoke(cli.main, ["runs", "--tag", tag])
        assert listed.exit_code == 2 and named in listed.stderr, listed.output
    twice = use_cli.invoke(cli.main, ["runs", "--tag", "a=1", "--tag", "a=2"])
    assert twice.exit_code == 2 and "tag 'a' given twice" in twice.stderr
    assert orc.runs(10) == [] and ledger_rows(orc) == 0


def test_bulk_retry_dry_run_then_apply(use_cli: CliRunner, orc: Orchestrator) -> None:
    failed = [orc.submit(etl(), tags={"customer": "42"}).id for _ in range(2)]
    ok = orc.submit(etl(), tags={"customer": "42"}).id
    other = orc.submit(etl(), tags={"customer": "7"}).id
    for run_id in (*failed, other):
        drive(orc, etl(), broken, run_id=run_id)
    drive(orc, etl(), run_id=ok)
    before = ledger_rows(orc)

    dry = use_cli.invoke(cli.main, ["bulk", "retry", "--tag", "customer=42", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    lines = dry.stdout.splitlines()
    assert sorted(line.split()[2] for line in lines if line.startswith("would retry")) == sorted(failed)
    skipped = [line for line in lines if line.startswith("skipped")]
    assert len(skipped) == 1 and ok in skipped[0] and "run SUCCEEDED: nothing to retry" in skipped[0]
    assert lines[-1] == (
        "bulk retry (dry run: nothing written): 2 run(s) would retry, 1 skipped, 0 failed, of 3 matching"
        " --tag customer=42"
    )
    assert ledger_rows(orc) == before

    done = use_cli.invoke(cli.main, ["bulk", "retry", "--tag", "customer=42", "--state", "FAILED", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert (report["matched"], report["changed"], report["skipped"], report["failed"]) == (2, 2, 0, 0)
    assert {r["run"] for r in report["runs"]} == set(failed) and {r["outcome"] for r in report["runs"]} == {"done"}
    for run_id in failed:
        assert orc.run_state(run_id) is RunState.RUNNING
        assert {e.by for e in orc.ledger(run_id) if e.actor == "operator"} == {cli_base._by()}
    assert orc.run_state(other) is RunState.FAILED


def test_bulk_cancel_and_rerun_and_their_refusals(use_cli: CliRunner, orc: Orchestrator) -> None:
    running = orc.submit(etl(), tags={"wave": "1"}).id
    finished = orc.submit(etl(), tags={"wave": "1"}).id
    drive(orc, etl(), run_id=finished)
    cancel = use_cli.invoke(cli.main, ["bulk", "cancel", "--tag", "wave=1"])
    assert cancel.exit_code == 0, cancel.output
    assert any(line.startswith("cancelled") and running in line for line in cancel.stdout.splitlines())
    assert "1 run(s) cancelled, 1 skipped, 0 failed, of 2 matching --tag wave=1" in cancel.stdout
    assert orc.run_state(running) is RunState.CANCELLED

    rerun = use_cli.invoke(cli.main, ["bulk", "rerun", "--tag", "wave=1", "--dag", "etl", "--json"])
    assert rerun.exit_code == 0, rerun.output
    new = [r["new_run"] for r in json.loads(rerun.stdout)["runs"]]
    assert len(new) == 2 and all(orc.visible(n).tags == {"wave": "1"} for n in new)

    before = ledger_rows(orc)
    for args, named in (
        (["bulk", "retry"], "a bulk action needs a filter"),
        (["bulk", "cancel", "--tenant", "default"], "a bulk action needs a filter"),
        (["bulk", "retry", "--tag", "wave"], "--tag takes KEY=VALUE"),
        (["bulk", "retry", "--state", "nope"], "unknown run state 'nope'"),
    ):
        out = use_cli.invoke(cli.main, args)
        assert out.exit_code == 2 and out.stderr.startswith("error: ") and named in out.stderr, (args, out.output)
    assert ledger_rows(orc) == before
    assert "--dry-run" in use_cli.invoke(cli.main, ["bulk", "retry", "--help"]).stdout


def test_submit_of_a_registered_dag_with_tags_keeps_its_version(use_cli: CliRunner, orc: Orchestrator) -> None:
    version = orc.register(etl()).version
    out = use_cli.invoke(cli.main, ["submit", "--dag", "etl", "--tag", "customer=42"])
    assert out.exit_code == 0, out.output
    view = orc.visible(out.stdout.strip())
    assert (view.dag, view.dag_version, view.tags) == ("etl", version, {"customer": "42"})
