"""Fixtures of the fault suite: its own database, its own redis-server, one Cluster per test.

A missing PostgreSQL or redis-server fails the tests (``pytest.fail``), it never skips them.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.conftest import ensure_database, reset_schema, test_database
from tests.fault.harness import Cluster, RedisServer

FAULT_DB = test_database("orchestrator_fault")


@pytest.fixture(scope="session")
def fault_db_url() -> str:
    url = ensure_database(FAULT_DB)
    reset_schema(url)
    return url


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis") / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _empty_tables(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            query = "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'"
            names = conn.execute(sa.text(query)).scalars().all()
            if names:
                conn.execute(sa.text("TRUNCATE " + ", ".join(f'"{n}"' for n in names) + " CASCADE"))
    finally:
        engine.dispose()


@pytest.fixture
def cluster(fault_db_url: str, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """A clean database and broker, and the settings every process of the scenario shares."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()  # a previous scenario may have left it down
    redis_server.client.flushall()
    _empty_tables(fault_db_url)
    env = {
        "ORCHESTRATOR_DATABASE_URL": fault_db_url,
        "ORCHESTRATOR_BROKER_URL": redis_server.url,
        "ORCHESTRATOR_DATA_DIR": str(tmp_path / "data"),
        "ORCHESTRATOR_LEASE_SECONDS": "2",
        "ORCHESTRATOR_TICK_SECONDS": "0.3",
        "ORCHESTRATOR_DISPATCH_TIMEOUT": "3",
        "ORCHESTRATOR_WORKER_TTL": "4",
        "ORCHESTRATOR_MAX_TIME_LIMIT": "120",
        "ORCHESTRATOR_RECORD_PROBE_EFFECTS": "1",
        "ORCHESTRATOR_HAZARD_PROBES": "1",
        # the beat tests fire every second and run the tests' factories
        "ORCHESTRATOR_SCHEDULE_MIN_INTERVAL_SECONDS": "0",
        "ORCHESTRATOR_DAG_FACTORY_MODULES": "tasks.dags,tests.factories",
    }
    c = Cluster(tmp_path, redis_server, fault_db_url, env)
    try:
        yield c
    finally:
        c.close()


def _rabbitmqctl(*args: str) -> None:
    done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.fail(f"rabbitmqctl {' '.join(args)} failed: {done.stderr}{done.stdout}")


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[str]:
    """The broker URL of a test run against both: the suite's Redis, and a RabbitMQ vhost of its own."""
    if request.param == "redis":
        yield cluster.settings.broker_url
        return
    vhost = f"orc-test-{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost)  # its queues go with it
