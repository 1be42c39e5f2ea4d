"""The command line of workers and code versions on one database: ``orchestrator workers``
(``--json``) lists the live workers with their queues, code versions and task counts; ``submit
--code-version`` pins a run (a spec file or a registered DAG)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import Orchestrator
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from tests.store.test_code_versions import Q, one_task, orc, register, row

pytestmark = pytest.mark.postgres

__all__ = ["orc"]  # the fixture


@pytest.fixture
def use_cli(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    return CliRunner()


def test_orchestrator_workers_lists_the_live_workers(use_cli: CliRunner, orc: Orchestrator) -> None:
    empty = use_cli.invoke(cli.main, ["workers"])
    assert empty.exit_code == 0 and empty.stdout.strip() == "no live worker (start one: orchestrator worker)"
    register(orc, "w-v1", "v1", ["t", "u"])
    orc.register_worker("w-any", [Q], 3)
    out = use_cli.invoke(cli.main, ["workers"])
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAME", "VERSION", "CONCURRENCY", "TASKS", "LAST", "SEEN", "QUEUES"]
    cells = [line.split() for line in lines[1:]]
    assert [(c[0], c[1], c[2], c[3], c[-1]) for c in cells] == [
        ("w-any", "-", "3", "*", Q), ("w-v1", "v1", "2", "2", f"{Q},{Q}@v1"),
    ]  # fmt: skip
    as_json = use_cli.invoke(cli.main, ["workers", "--json"])
    assert as_json.exit_code == 0, as_json.output
    listed = json.loads(as_json.stdout)["workers"]
    assert [(w["name"], w["code_version"], w["task_count"], w["tasks"], w["queues"]) for w in listed] == [
        ("w-any", None, None, None, [Q]), ("w-v1", "v1", 2, ["t", "u"], [Q, f"{Q}@v1"]),
    ]  # fmt: skip
    assert set(listed[0]) == {
        "name", "queues", "code_version", "task_count", "tasks", "concurrency", "started_at", "seen_at",
        "seen_seconds_ago",
    }  # fmt: skip


def test_submit_code_version_on_the_command_line(use_cli: CliRunner, orc: Orchestrator, tmp_path: Path) -> None:
    spec = tmp_path / "dag.yaml"
    spec.write_text("name: etl\nnodes:\n  - {key: x, task: t}\n")
    out = use_cli.invoke(cli.main, ["submit", str(spec), "--code-version", "v9"])
    assert out.exit_code == 0, out.output
    run_id = out.stdout.strip()
    assert row(orc, run_id).queue == f"{Q}@v9"
    bad = use_cli.invoke(cli.main, ["submit", str(spec), "--code-version", "no good"])
    assert bad.exit_code == 2 and "code_version must be 1-64 letters" in bad.stderr, bad.output
    # a registered DAG, pinned
    orc.dags.register(one_task())
    registered = use_cli.invoke(cli.main, ["submit", "--dag", "versioned", "--code-version", "v9"])
    assert registered.exit_code == 0, registered.output
    pinned = row(orc, registered.stdout.strip())
    assert pinned.queue == f"{Q}@v9"
    assert orc.run(registered.stdout.strip()).status().dag_version == 1
