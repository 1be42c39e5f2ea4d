"""Task groups in a run: a grouped DAG runs with its prefixed keys (Celery task ids
``<run>.<group>.<key>.<attempt>`` parsed back), its group defaults on the rows, ``explain``'s
command line folds a group's tasks into one entry (``--expand`` lists them), and the run page's
API pages edges past a dotted key (the ``~`` cursor). The workers' part is played by
``dynamic.drive``; the Airflow example runs on a real worker in tests/integration."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from orchestrator import DAG, Orchestrator
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.core.protocol import parse_task_id, task_id
from orchestrator.services.invariants import check_runs
from tests.store.dynamic import drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def grouped() -> DAG:
    dag = DAG("grouped")
    start = dag.task("start", "t")
    with dag.group("section_1", upstream=[start], max_attempts=2) as s1:
        dag.task("task_1", "t")
        dag.map("each", "t", over="task_1", kwarg="x")
    dag.task("end", "up", upstream=[s1])
    return dag


def test_a_grouped_dag_runs_with_its_prefixed_keys(orc: Orchestrator) -> None:
    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        return [1, 2] if key == "section_1.task_1" else kw.get("x", up)

    d = drive(orc, grouped(), body)
    assert d.run_state() == "SUCCEEDED"
    assert sorted(d.states()) == [
        "end", "section_1.each", "section_1.each[0]", "section_1.each[1]", "section_1.task_1", "start",
    ]  # fmt: skip
    assert d.ran[-1] == ("end", {}, {"section_1.each": [1, 2]})
    row = orc.task(d.run_id, "section_1.task_1")
    assert row.max_attempts == 2  # the group's default
    tid = task_id(d.run_id, "section_1.each[0]", 3)
    assert parse_task_id(tid) == (d.run_id, "section_1.each[0]", 3)
    assert check_runs(orc.store, [d.run_id]) == []


def test_explain_folds_a_groups_tasks(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch) -> None:
    d = drive(orc, grouped(), lambda k, kw, up: None, until=lambda d: False, steps=0)
    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    folded = CliRunner().invoke(cli.main, ["explain", d.run_id])
    assert folded.exit_code == 0, folded.output
    assert "section_1.*  group of 2: 2 PENDING" in folded.stdout
    assert "section_1.task_1  PENDING" not in folded.stdout
    assert "start  " in folded.stdout and "end  PENDING" in folded.stdout
    expanded = CliRunner().invoke(cli.main, ["explain", d.run_id, "--expand"])
    assert "section_1.task_1  PENDING" in expanded.stdout and "group of" not in expanded.stdout
    as_json = CliRunner().invoke(cli.main, ["explain", d.run_id, "--json"])
    assert '"group": "section_1"' in as_json.stdout
