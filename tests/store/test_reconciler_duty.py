"""One reconciler on duty at a time across a Postgres deployment, and the duty moves when the
process (here: the session) on duty dies or stalls."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from orchestrator import Orchestrator, Settings
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.services.reconciler import ReconcilerService
from tests.conftest import empty_tables

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_url: str) -> Iterator[Orchestrator]:
    o = Orchestrator(
        Settings.from_env({}, database_url=pg_url),
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t"]),
    )
    empty_tables(o.store.engine)
    yield o
    o.store.dispose()


def on_duty(orc: Orchestrator) -> list[str]:
    """``application_name`` of the session holding the reconciler duty in the test database."""
    return orc.store.reads.reconciler_on_duty()


def service(orc: Orchestrator, name: str, stall: float = 10.0) -> ReconcilerService:
    return ReconcilerService(orc.reconciler, name=name, interval=0.1, stall_seconds=stall)


def test_one_on_duty_and_the_duty_moves_when_its_session_dies(orc: Orchestrator) -> None:
    a, b = service(orc, "a"), service(orc, "b")
    try:
        assert a.step() is not None  # a takes the duty and runs a pass
        assert b.step() is None  # b waits
        assert a.step() is not None and a.passes == 2
        assert on_duty(orc) == ["orchestrator-reconciler:a"]
        # the process on duty is killed: its session ends, the lock is free at once
        with orc.store.engine.connect() as conn:
            conn.execute(
                sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"),
                {"n": "orchestrator-reconciler:a"},
            )
        deadline = time.monotonic() + 5
        while b.step() is None:
            assert time.monotonic() < deadline, "the duty did not move"
            time.sleep(0.05)
        assert on_duty(orc) == ["orchestrator-reconciler:b"]
        assert a.step() is None  # a notices it lost the duty and waits
    finally:
        a.release()
        b.release()


def test_a_stalled_session_on_duty_is_ended_by_the_server(orc: Orchestrator) -> None:
    a, b = service(orc, "a", stall=1.0), service(orc, "b")
    try:
        assert a.step() is not None
        assert b.step() is None
        time.sleep(1.6)  # a "paused": no statement on its duty session for longer than the stall
        assert b.step() is not None
        assert on_duty(orc) == ["orchestrator-reconciler:b"]
    finally:
        a.release()
        b.release()


def test_release_hands_the_duty_over(orc: Orchestrator) -> None:
    a, b = service(orc, "a"), service(orc, "b")
    try:
        assert a.step() is not None
        a.release()
        assert b.step() is not None
    finally:
        a.release()
        b.release()


def test_the_duty_lives_on_a_connection_of_its_own(pg_url: str) -> None:
    # a store whose pool holds one connection: the duty's lock never takes it from the pool
    o = Orchestrator(
        Settings.from_env({}, database_url=pg_url, db_pool_size=1),
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t"]),
    )
    a = service(o, "own")
    try:
        assert a.step() is not None and a.step() is not None  # the passes use the pool's one connection
        with o.store.engine.connect() as conn:  # and the pool's connection is free between passes
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
        assert on_duty(o) == ["orchestrator-reconciler:own"]
    finally:
        a.release()
        o.store.dispose()


def test_through_a_transaction_pooler_the_duty_needs_a_direct_url(pg_url: str) -> None:
    from orchestrator.core.errors import ConfigurationError

    pooled = Settings.from_env({}, database_url=pg_url, db_transaction_pooler=True)
    o = Orchestrator(pooled, publisher=RecordingPublisher(), registry=StaticRegistry(["t"]))
    try:
        with pytest.raises(ConfigurationError, match="ORCHESTRATOR_DB_DIRECT_URL"):
            service(o, "refused")
    finally:
        o.store.dispose()
    direct = Settings.from_env({}, database_url=pg_url, db_transaction_pooler=True, db_direct_url=pg_url)
    o = Orchestrator(direct, publisher=RecordingPublisher(), registry=StaticRegistry(["t"]))
    a = service(o, "direct")
    try:
        assert a.step() is not None
        assert on_duty(o) == ["orchestrator-reconciler:direct"]
    finally:
        a.release()
        o.store.dispose()


def test_a_pool_size_below_one_is_refused() -> None:
    from orchestrator.core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="ORCHESTRATOR_DB_POOL_SIZE=0 must be at least 1"):
        Settings.from_env({"ORCHESTRATOR_DB_POOL_SIZE": "0"})


def test_a_worker_through_a_transaction_pooler_without_a_direct_url_refuses_to_start() -> None:
    from orchestrator.core.errors import ConfigurationError
    from orchestrator.runtime.celery_app import check_worker_settings, create_app

    pooled = {"database_url": "postgresql://u@pgbouncer:6432/db", "db_transaction_pooler": True}
    app = create_app(Settings.from_env({}, broker_url="redis://127.0.0.1:6379/13", **pooled))
    with pytest.raises(ConfigurationError, match="ORCHESTRATOR_DB_DIRECT_URL"):
        check_worker_settings(app)
    # with the direct URL, or without the reconciler in the worker, it starts
    check_worker_settings(
        create_app(
            Settings.from_env(
                {}, broker_url="redis://127.0.0.1:6379/13", db_direct_url="postgresql://u@db/db", **pooled
            )
        )
    )
    check_worker_settings(
        create_app(Settings.from_env({}, broker_url="redis://127.0.0.1:6379/13", worker_reconciler=False, **pooled))
    )
