"""The plugin in a fresh project outside this repository: one DAG module and one test file in
a temporary directory, run with ``pytest`` in a subprocess. Installing the package is all it
takes (the ``pytest11`` entry point); the database is a ``test_<name>`` beside
``ORCHESTRATOR_DATABASE_URL``'s, or, with none set, an embedded PostgreSQL started for the run
and stopped at its end."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.conftest import db_url
from tests.conftest import test_database as database_name

pytestmark = pytest.mark.postgres

DAGS = """
from orchestrator import DAG
from orchestrator.runtime.celery_app import get_app

app = get_app()


@app.task(name="shop.charge")
def charge(amount: float) -> dict:
    return {"charged": amount}


@app.task(name="shop.receipt")
def receipt(upstream: dict) -> str:
    return f"receipt for {upstream['charge']['charged']}"


def checkout(amount: float) -> DAG:
    dag = DAG("checkout")
    paid = dag.task("charge", charge.s(amount=amount), max_attempts=3)
    dag.wait("cooling_off", delay=14 * 86400, upstream=[paid])
    dag.task("receipt", receipt.s(), upstream=[paid, "cooling_off"])
    return dag
"""

TESTS = """
from orchestrator.testing import FailTimes, run_dag

from dags import checkout


def test_checkout_survives_a_flaky_charge_and_two_weeks():
    result = run_dag(checkout(9.5), faults={"charge": FailTimes(1, exc=ConnectionError)})
    assert result.state == "SUCCEEDED", result.explain()
    assert result.results["receipt"] == "receipt for 9.5"
    assert result.attempts["charge"] == 2
    assert result.elapsed.days >= 14


def test_the_clock_is_the_test_s(orchestrator):
    result = orchestrator.run_dag(checkout(1.0), auto_advance=False)
    assert result.states["cooling_off"] == "WAITING"
    orchestrator.clock.advance(days=14)
    assert result.resume(auto_advance=False).state == "SUCCEEDED"
"""


def project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "shop"
    root.mkdir()
    (root / "dags.py").write_text(textwrap.dedent(DAGS))
    (root / "test_checkout.py").write_text(textwrap.dedent(TESTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHESTRATOR_", "PYTEST_"))}
    env["ORCHESTRATOR_DATA_DIR"] = str(tmp_path / "data")
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    return root, env


def pytest_in(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_a_fresh_project_on_a_database_url(tmp_path: Path) -> None:
    scratch = database_name("orchestrator_fresh")
    root, env = project(tmp_path)
    env["ORCHESTRATOR_DATABASE_URL"] = db_url(scratch)
    done = pytest_in(root, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    # the kit used a database of its own beside the configured one, never the configured one
    admin = sa.create_engine(db_url("postgres"))
    try:
        with admin.connect() as conn:
            names = set(conn.execute(sa.text("SELECT datname FROM pg_database")).scalars())
    finally:
        admin.dispose()
    assert f"test_{scratch}" in names


def test_a_fresh_project_on_an_embedded_postgres(tmp_path: Path) -> None:
    root, env = project(tmp_path)
    done = pytest_in(root, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
    # the embedded server was stopped and its directory removed at the end of the run
    assert list((tmp_path / "tmp").glob("orc-kit-*")) == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in ps
