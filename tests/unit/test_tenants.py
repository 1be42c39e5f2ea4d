"""The tenant boundary: an orchestrator bound to a tenant (``tenant=`` or ORCHESTRATOR_TENANT)
sees, acts on and submits its own tenant's runs only; every cross-tenant attempt is refused and
changes nothing. Also through the command line, as the issue's operator would try it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import DAG, Orchestrator, RunNotFound, Settings, TaskState, ValidationError
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def db(pg_clean: str) -> str:
    return pg_clean


def _orc(db: str, tenant: str | None, tmp_path: Path) -> Orchestrator:
    settings = Settings.from_env({}, database_url=db, data_dir=str(tmp_path), dedicated_tenants=("acme",))
    orc = Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(["t.ok"]), tenant=tenant)
    return orc


@pytest.fixture
def acme_run(db: str, tmp_path: Path) -> Iterator[tuple[Orchestrator, str]]:
    acme = _orc(db, "acme", tmp_path)
    dag = DAG("report")
    dag.task("a", "t.ok")
    run = acme.submit(dag, idempotency_key="nightly")
    yield acme, run.id
    acme.store.dispose()


def test_a_bound_orchestrator_submits_as_its_tenant(acme_run: tuple[Orchestrator, str]) -> None:
    acme, run_id = acme_run
    assert acme.run(run_id).status().tenant == "acme"
    other = DAG("x", tenant="beta")
    other.task("a", "t.ok")
    with pytest.raises(ValidationError, match="acts as tenant 'acme'; it cannot submit for tenant 'beta'"):
        acme.submit(other)
    mine = DAG("x")
    mine.task("a", "t.ok")
    with pytest.raises(ValidationError, match="cannot submit for tenant 'beta'"):
        acme.submit(mine, tenant="beta")


def test_another_tenant_cannot_see_or_touch_the_run(
    acme_run: tuple[Orchestrator, str], db: str, tmp_path: Path
) -> None:
    acme, run_id = acme_run
    beta = _orc(db, "beta", tmp_path)
    before = acme.run(run_id).events()
    for attempt in (
        lambda: beta.run(run_id),
        lambda: beta.cancel(run_id),
        lambda: beta.retry_task(run_id, "a"),
        lambda: beta.skip_task(run_id, "a"),
        lambda: beta.fail_task(run_id, "a"),
    ):
        with pytest.raises(RunNotFound):
            attempt()
    assert beta.runs() == [] and beta.runs(tenant="acme") == []
    # the idempotency key is looked up within the caller's tenant: beta gets its own run
    dag = DAG("report")
    dag.task("a", "t.ok")
    theirs = beta.submit(dag, idempotency_key="nightly")
    assert theirs.id != run_id and theirs.status().tenant == "beta"
    # nothing changed on acme's run
    assert acme.run(run_id).events() == before
    assert acme.run(run_id).task("a").state is TaskState.QUEUED or acme.run(run_id).task("a").state is TaskState.READY
    # the deployment's operator (unbound) sees both
    admin = _orc(db, None, tmp_path)
    assert {v.tenant for v in admin.runs()} == {"acme", "beta"}
    beta.store.dispose()
    admin.store.dispose()


def test_a_dag_cannot_route_to_another_tenants_dedicated_queue(db: str, tmp_path: Path) -> None:
    evil = _orc(db, None, tmp_path)
    evil.register_worker("w", default_queues(("acme",)), 2)
    dag = DAG("steal", tenant="evil")
    dag.task("a", "t.ok", queue="orchestrator.tenant.acme.high")
    with pytest.raises(ValidationError, match="tenant 'acme''s dedicated queue"):
        evil.submit(dag)
    assert evil.runs() == []
    ok = DAG("own", tenant="acme")
    ok.task("a", "t.ok", queue="orchestrator.tenant.acme.high")
    assert evil.submit(ok).status().tenant == "acme"  # the operator may, for acme's own DAG
    evil.store.dispose()


def test_the_cli_acts_as_the_tenant_it_is_given(acme_run: tuple[Orchestrator, str], db: str, tmp_path: Path) -> None:
    acme, run_id = acme_run
    before = acme.run(run_id).events()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env.update(ORCHESTRATOR_DATABASE_URL=db, ORCHESTRATOR_DATA_DIR=str(tmp_path))

    def cli(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args],
            cwd=ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )

    for args in (("status", run_id), ("cancel", run_id), ("retry", run_id, "a"), ("events", run_id)):
        done = cli(*args, ORCHESTRATOR_TENANT="beta")
        assert done.returncode == 2 and f"error: no run with id '{run_id}'" in done.stderr, (args, done.stderr)
        done = cli("--tenant", "beta", *args)
        assert done.returncode == 2 and "no run with id" in done.stderr, (args, done.stderr)
    assert acme.run(run_id).events() == before
    assert cli("--tenant", "acme", "status", run_id).returncode == 0
    assert run_id in cli("status", run_id).stdout  # unset: the deployment's operator


def test_a_dedicated_tenant_gets_its_own_queues(db: str, tmp_path: Path) -> None:
    from orchestrator.cli.workers import worker_argv

    admin = _orc(db, None, tmp_path)
    admin.tenants.set_dedicated("big")
    dag = DAG("work", tenant="big", priority="high")
    dag.task("a", "t.ok")
    assert admin.submit(dag).task("a").queue == "orchestrator.tenant.big.high"
    shared = DAG("work", tenant="small")
    shared.task("a", "t.ok")
    assert admin.submit(shared).task("a").queue == "orchestrator.default"
    admin.tenants.set_dedicated("big", False)  # back to the shared queues for new runs
    assert admin.submit(dag).task("a").queue == "orchestrator.high"
    assert admin.tenants.all()["big"] == (1.0, None, False)
    # the worker that serves a dedicated tenant
    queues = "orchestrator.tenant.big.high,orchestrator.tenant.big.default,orchestrator.tenant.big.low"
    assert worker_argv(["--tenant", "big", "-c", "4"]) == ["-Q", queues, "-c", "4"]
    assert worker_argv(["--tenant=big"]) == ["-Q", queues]
    with pytest.raises(ValidationError, match="tenant"):
        worker_argv(["--tenant", "no good"])
    with pytest.raises(ValidationError):
        admin.tenants.set_dedicated("bad name")
    admin.store.dispose()
