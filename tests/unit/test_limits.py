"""Pools, rate limits and run/DAG limits at the entry points: the Python API and the command
line refuse unknown names, malformed rates and impossible slot counts with a named error,
before anything is written; a spec file carries the new fields. (Admission's enforcement is in
tests/store/test_store.py on both backends, and with real workers in tests/fault/test_limits.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, Settings, UnknownLimitError, ValidationError
from orchestrator.core.dag import dag_from_spec, load_spec
from orchestrator.core.errors import SpecError
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.store import schema as s
from tests.conftest import migrated_test_database

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def orc(tmp_path: Path, pg_clean: str) -> Iterator[Orchestrator]:
    o = Orchestrator(
        Settings.from_env({}, data_dir=str(tmp_path), database_url=pg_clean),
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t"]),
    )
    o.limits.set_pool("warehouse", 4)
    o.limits.set_rate_limit("stripe-api", "10/s")
    yield o
    o.store.dispose()


def one(**node: Any) -> DAG:
    dag = DAG("d")
    dag.task("a", "t", **node)
    return dag


@pytest.mark.parametrize(
    ("node", "error", "message"),
    [
        ({"pool": "nope"}, UnknownLimitError, "pool 'nope' does not exist"),
        ({"rate_limit": "nope"}, UnknownLimitError, "rate limit 'nope' does not exist"),
        ({"pool": "warehouse", "pool_slots": 5}, ValidationError, "pool_slots 5 exceed pool 'warehouse''s 4 slots"),
        ({"pool_slots": 2}, ValidationError, "pool_slots needs a pool"),
        ({"pool": "warehouse", "pool_slots": 0}, ValidationError, "pool_slots must be an integer from 1"),
        ({"pool": "warehouse", "pool_slots": True}, ValidationError, "pool_slots must be an integer"),
        ({"pool": "bad name"}, ValidationError, "pool 'bad name' must be 1-64"),
        ({"rate_limit": ""}, ValidationError, "rate_limit '' must be 1-64"),
        ({"pool": 3}, ValidationError, "pool 3 must be 1-64"),
    ],
)
def test_submit_refuses_bad_pools_and_limits_and_writes_nothing(
    orc: Orchestrator, node: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as info:
        orc.submit(one(**node))
    assert info.value.node == "a"  # type: ignore[attr-defined]
    assert orc.runs() == [] and orc.publisher.sent == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "3", 10**7])
def test_max_active_tasks_is_validated(orc: Orchestrator, value: Any) -> None:
    dag = DAG("d", max_active_tasks=value)
    dag.task("a", "t")
    with pytest.raises(ValidationError, match="max_active_tasks must be an integer from 1"):
        orc.submit(dag)
    assert orc.runs() == []


def test_a_valid_dag_with_limits_is_stored_with_them(orc: Orchestrator) -> None:
    dag = DAG("d", max_active_tasks=2)
    dag.task("a", "t", pool="warehouse", pool_slots=3, rate_limit="stripe-api")
    dag.task("b", "t")
    run = orc.submit(dag)
    with orc.store.engine.connect() as conn:
        spec = conn.execute(sa.select(s.runs.c.dag_snapshot).where(s.runs.c.id == run.id)).scalar_one()
        rows = {r.key: r for r in conn.execute(sa.select(s.tasks).where(s.tasks.c.run_id == run.id))}
    assert (rows["a"].pool, rows["a"].pool_slots, rows["a"].rate_limit) == ("warehouse", 3, "stripe-api")
    assert (rows["b"].pool, rows["b"].pool_slots, rows["b"].rate_limit) == (None, 1, None)
    assert spec["max_active_tasks"] == 2
    assert spec["nodes"][0] == {**spec["nodes"][0], "pool": "warehouse", "pool_slots": 3, "rate_limit": "stripe-api"}
    assert "pool" not in spec["nodes"][1] and "rate_limit" not in spec["nodes"][1]
    again = dag_from_spec(json.loads(json.dumps(spec)))
    assert again.max_active_tasks == 2 and again.nodes["a"].pool_slots == 3


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_active_tasks: true\n", "'max_active_tasks' must be an integer"),
        ("max_active_tasks: '2'\n", "'max_active_tasks' must be an integer"),
        ("nodes: [{key: a, task: t, pool: [x]}]\n", "'pool' must be a pool name"),
        ("nodes: [{key: a, task: t, pool: p, pool_slots: 1.5}]\n", "'pool_slots' must be an integer"),
        ("nodes: [{key: a, task: t, pool: p, pool_slots: true}]\n", "'pool_slots' must be an integer"),
        ("nodes: [{key: a, task: t, rate_limit: 10}]\n", "'rate_limit' must be a rate limit key"),
    ],
)
def test_spec_files_type_the_new_fields(tmp_path: Path, text: str, message: str) -> None:
    body = (
        "name: d\n"
        + (text if text.startswith("max") else "")
        + ("nodes: [{key: a, task: t}]\n" if text.startswith("max") else text)
    )
    path = tmp_path / "d.yaml"
    path.write_text(body)
    with pytest.raises(SpecError, match=message):
        load_spec(path)


@pytest.mark.parametrize(
    ("rate", "burst", "message"),
    [
        ("10", None, "must look like 10/s"),
        ("ten/s", None, "must look like 10/s"),
        ("10/d", None, "must look like 10/s"),
        ("0/s", None, "must be above 0"),
        ("-1/s", None, "must look like 10/s"),
        ("1/s", 0, "burst must be an integer from 1"),
        ("1/s", 10**9, "burst must be an integer from 1"),
        (float("nan"), None, "rate must be above 0"),
        (True, None, "rate must be above 0"),
    ],
)
def test_malformed_rates_are_refused(orc: Orchestrator, rate: Any, burst: Any, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        orc.limits.set_rate_limit("other", rate, burst)
    assert [r.key for r in orc.limits.rate_limits()] == ["stripe-api"]


def test_rates_read_as_tokens_per_second(orc: Orchestrator) -> None:
    assert orc.limits.set_rate_limit("a", "600/m").rate == 10.0
    assert orc.limits.set_rate_limit("b", "5/h").rate_text == "5/h"
    assert orc.limits.set_rate_limit("c", "0.5/s").burst == 1
    assert orc.limits.set_rate_limit("d", "25/s").burst == 25


def test_a_tenant_bound_orchestrator_cannot_change_deployment_wide_limits(tmp_path: Path, pg_clean: str) -> None:
    acme = Orchestrator(
        Settings.from_env({}, data_dir=str(tmp_path), database_url=pg_clean),
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t"]),
        tenant="acme",
    )
    for call in (
        lambda: acme.limits.set_pool("p", 1),
        lambda: acme.limits.set_rate_limit("k", "1/s"),
        lambda: acme.limits.remove_pool("p"),
    ):
        with pytest.raises(ValidationError, match="deployment-wide"):
            call()
    acme.limits.set_dag_limit("nightly", 3)  # its own tenant's DAG
    with pytest.raises(ValidationError, match="cannot change tenant 'beta'"):
        acme.limits.set_dag_limit("nightly", 3, tenant="beta")
    assert acme.limits.dag_limits() == {("acme", "nightly"): 3}
    acme.store.dispose()


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ORCHESTRATOR_DATA_DIR": str(tmp_path), "ORCHESTRATOR_DATABASE_URL": migrated_test_database()}
    env.pop("ORCHESTRATOR_TENANT", None)
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


def test_the_pool_limit_and_dag_commands(tmp_path: Path, pg_clean: str) -> None:
    out = cli(tmp_path, "pool", "set", "warehouse", "--slots", "4", "--description", "the DWH")
    assert out.returncode == 0 and "pool warehouse: 4 slot(s), 0 in use" in out.stdout, out.stderr
    listed = json.loads(cli(tmp_path, "pool", "list", "--json").stdout)
    assert listed == {"pools": [{"name": "warehouse", "slots": 4, "used": 0, "description": "the DWH"}]}
    out = cli(tmp_path, "limit", "set", "stripe-api", "--rate", "10/s", "--burst", "20")
    assert out.returncode == 0 and "rate limit stripe-api: 10/s, burst 20" in out.stdout
    assert json.loads(cli(tmp_path, "limit", "list", "--json").stdout)["rate_limits"][0]["burst"] == 20
    bad = cli(tmp_path, "limit", "set", "x", "--rate", "10 per second")
    assert bad.returncode == 2 and "error: rate '10 per second' must look like 10/s" in bad.stderr
    assert bad.stderr.count("\n") == 1  # one line, no traceback
    bad = cli(tmp_path, "pool", "set", "p", "--slots", "0")
    assert bad.returncode == 2 and "slots must be an integer from 1" in bad.stderr
    out = cli(tmp_path, "--tenant", "acme", "dag", "set", "nightly", "--max-running", "3")
    assert out.returncode == 0 and "DAG nightly (tenant acme): max running 3" in out.stdout
    assert "acme  nightly  max running 3" in cli(tmp_path, "dag", "list").stdout
    gone = cli(tmp_path, "pool", "remove", "nope")  # an error as any other: one line, exit 2
    assert gone.returncode == 2 and gone.stderr == "error: no pool named 'nope'\n", gone.stderr
    assert cli(tmp_path, "pool", "remove", "warehouse").returncode == 0
    spec = tmp_path / "d.yaml"
    spec.write_text(
        "name: d\nnodes:\n  - {key: a, task: tasks.etl.extract_orders, kwargs: {day: x}, pool: warehouse}\n"
    )
    bad = cli(tmp_path, "submit", str(spec))
    assert bad.returncode == 2 and "pool 'warehouse' does not exist" in bad.stderr
    assert cli(tmp_path, "runs", "--json").stdout.count('"id"') == 0
