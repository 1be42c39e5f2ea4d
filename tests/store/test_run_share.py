"""Runs of one tenant share admission (``orc_admit_from_v2``): a small run submitted behind a big
run's READY backlog is admitted as soon as a slot frees, not after the backlog; runs of different
tenants and priority classes keep their order. The workers' part is played here: the oldest QUEUED
task is claimed and succeeds through the store calls a worker makes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.core.models import Claim
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.services.invariants import check_runs
from orchestrator.store import Store
from orchestrator.store.schema import tasks as t

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    store = Store(pg_clean)
    store.workers.register("w", default_queues(), 2)  # room: 2 slots x depth 2 = 4 in flight
    o = Orchestrator(
        Settings(database_url=pg_clean), store=store, publisher=RecordingPublisher(), registry=StaticRegistry(["t"])
    )
    yield o
    store.attempts.hot.close()
    store.dispose()


def work_one(orc: Orchestrator) -> str | None:
    """Claim the oldest QUEUED task and succeed it (its completion hands its slot on); returns
    ``run/key``, or ``None`` when nothing is QUEUED."""
    store = orc.store
    with store.engine.connect() as conn:
        row = conn.execute(
            sa.select(t.c.run_id, t.c.key, t.c.attempt, t.c.task_name)
            .where(t.c.state == "QUEUED")
            .order_by(t.c.dispatched_at, t.c.run_id, t.c.key)
            .limit(1)
        ).first()
    if row is None:
        return None
    claim = store.attempts.claim(row.run_id, row.key, row.attempt, "w:1", 60.0, row.task_name)
    assert isinstance(claim, Claim)
    store.attempts.succeed(row.run_id, row.key, row.attempt, None, 10_000)
    return f"{row.run_id}/{row.key}"


def wide(name: str, n: int, **options: object) -> DAG:
    dag = DAG(name, **options)  # type: ignore[arg-type]
    for i in range(n):
        dag.task(f"t{i}", "t")
    return dag


def small(name: str = "small", **options: object) -> DAG:
    dag = DAG(name, **options)  # type: ignore[arg-type]
    dag.task("a", "t")
    dag.task("b", "t", upstream=["a"])
    return dag


def finish(orc: Orchestrator, run_id: str) -> list[str]:
    """Work until ``run_id`` is final; returns what ran before, in order."""
    done: list[str] = []
    while orc.run_state(run_id).value not in ("SUCCEEDED", "FAILED"):
        ran = work_one(orc)
        assert ran is not None, "nothing QUEUED while the run is open"
        done.append(ran)
    return done


def test_a_small_run_behind_a_big_runs_backlog_of_its_tenant_runs_at_once(orc: Orchestrator) -> None:
    big = orc.submit(wide("big", 300)).id
    for _ in range(10):
        work_one(orc)
    little = orc.submit(small()).id
    ran = finish(orc, little)
    big_before = [r for r in ran if r.startswith(big)]
    # the run's two tasks, each behind at most the big run's tasks already in flight
    assert len(big_before) <= 8, len(big_before)
    while work_one(orc) is not None:
        pass
    assert orc.run_state(big).value == "SUCCEEDED"
    assert check_runs(orc.store, [big, little]) == []


def test_runs_of_a_tenant_alternate_while_both_have_a_backlog(orc: Orchestrator) -> None:
    first = orc.submit(wide("first", 100)).id
    second = orc.submit(wide("second", 100)).id
    order = [work_one(orc) for _ in range(60)]
    share = sum(1 for r in order if r is not None and r.startswith(second)) / len(order)
    assert 0.4 <= share <= 0.6, share  # by tasks in flight: each run holds about half the slots
    while work_one(orc) is not None:
        pass
    assert check_runs(orc.store, [first, second]) == []


def test_a_higher_priority_class_still_goes_first(orc: Orchestrator) -> None:
    low = orc.submit(wide("low", 50, priority="low")).id
    high = orc.submit(wide("high", 20, priority="high")).id
    order = [work_one(orc) for _ in range(30)]
    # after the low run's first tasks (admitted before the high run existed), only the high run's
    first_high = next(i for i, r in enumerate(order) if r is not None and r.startswith(high))
    assert first_high <= 4
    assert all(r is not None and r.startswith(high) for r in order[first_high + 4 : first_high + 20])
    while work_one(orc) is not None:
        pass
    assert check_runs(orc.store, [low, high]) == []


def test_a_default_cap_per_run_holds_a_dag_that_sets_none(pg_clean: str) -> None:
    store = Store(pg_clean)
    store.workers.register("w", default_queues(), 20)  # room for 40: the cap is what holds
    settings = Settings(database_url=pg_clean, run_max_active_tasks=16)
    o = Orchestrator(settings, store=store, publisher=RecordingPublisher(), registry=StaticRegistry(["t"]))
    try:
        capped = o.submit(wide("capped", 50)).id
        raised = o.submit(wide("raised", 50, max_active_tasks=30)).id
        with store.engine.connect() as conn:
            flying = dict(
                conn.execute(
                    sa.select(t.c.run_id, sa.func.count()).where(t.c.state == "QUEUED").group_by(t.c.run_id)
                ).all()
            )
        assert flying[capped] == 16  # ORCHESTRATOR_RUN_MAX_ACTIVE_TASKS
        assert flying[raised] == 24  # its own 30, within the room left (40 - 16)
        (reason,) = [r for r in o.explain(capped, "t40")[0].reasons if r.kind == "run_limit"]
        assert "16" in reason.detail
    finally:
        store.attempts.hot.close()
        store.dispose()


def test_the_default_cap_is_read_from_the_environment_and_refused_below_zero() -> None:
    from orchestrator.core.errors import ConfigurationError

    assert Settings.from_env({"ORCHESTRATOR_RUN_MAX_ACTIVE_TASKS": "16"}).run_max_active_tasks == 16
    assert Settings.from_env({}).run_max_active_tasks == 0
    with pytest.raises(ConfigurationError, match="RUN_MAX_ACTIVE_TASKS=-1 must be 0"):
        Settings.from_env({"ORCHESTRATOR_RUN_MAX_ACTIVE_TASKS": "-1"})
