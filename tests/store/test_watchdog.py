"""The watchdog (issue 36): "no progress" is an alert, never silence. A task whose message the
reconciler re-published N times without a claim is flagged (``needs_attention``, a
``task_stuck`` alert, ``orchestrator_stuck_tasks``, an ``explain`` reason); admission holds a
READY task that no live worker of its queue registered, and one a worker dropped as unregistered,
until a worker that has it registers. Workers are played by store calls (no Celery)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import DAG, Orchestrator
from orchestrator.core.routing import default_queues
from orchestrator.services import alerts
from orchestrator.services.reconciler import Reconciler
from orchestrator.store import schema as s
from orchestrator.store.schema import events as ev
from orchestrator.store.schema import tasks as t
from orchestrator.store.workers import MAX_DROPS_BEFORE_HOLD
from orchestrator.web.metrics import render
from tests.store.dynamic import orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    # dispatch_timeout 0: a QUEUED task is stale at once; tick 0: an idle slot is confirmed at once
    o = orchestrator(pg_clean, dispatch_timeout=0.0, tick_seconds=0.0)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


@pytest.fixture
def alerted() -> Iterator[list[dict[str, Any]]]:
    got: list[dict[str, Any]] = []

    def receive(sender: Any = None, alert: dict[str, Any] | None = None, **_: Any) -> None:
        got.append(dict(alert or {}))

    signal = alerts._KINDS.get("task_stuck", alerts._KINDS[None])[1]
    signal.connect(receive, weak=False)
    yield got
    signal.disconnect(receive)


def one_task(name: str = "t") -> DAG:
    dag = DAG("watched")
    dag.task("x", name)
    return dag


def state(orc: Orchestrator, run_id: str, key: str = "x") -> Any:
    with orc.store.engine.connect() as conn:
        return conn.execute(sa.select(t).where(t.c.run_id == run_id, t.c.key == key)).one()


def republishes(orc: Orchestrator, run_id: str) -> int:
    with orc.store.engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).where(
                    ev.c.run_id == run_id,
                    ev.c.from_state == "QUEUED",
                    ev.c.to_state == "QUEUED",
                    ev.c.accepted,
                    ev.c.kind.is_(None),
                )
            ).scalar_one()
        )


def stuck_metric(orc: Orchestrator) -> dict[tuple[str, str], float]:
    body, _ = render(orc)
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "orchestrator_stuck_tasks":
                found[(sample.labels["kind"], sample.labels["tenant"])] = sample.value
    return found


def sql_now(orc: Orchestrator, query: Any) -> bool:
    with orc.store.engine.connect() as conn:
        return bool(conn.execute(query).scalar())


def reasons(orc: Orchestrator, run_id: str, key: str = "x") -> dict[str, str]:
    return {r.kind: r.detail for r in orc.explain(run_id, key)[0].reasons}


def test_a_message_republished_n_times_without_a_claim_is_flagged(
    orc: Orchestrator, alerted: list[dict[str, Any]]
) -> None:
    # Given a task admitted whose message no worker ever takes
    run = orc.submit(one_task())
    assert state(orc, run.id).state == "QUEUED"
    assert not orc.run(run.id).status().needs_attention
    # When the reconciler re-publishes it three times (the default ORCHESTRATOR_STUCK_REPUBLISHES)
    reconciler = orc.reconciler
    for _ in range(3):
        reconciler.run_pass()
    assert republishes(orc, run.id) == 3
    # Then the run needs attention, one alert names the task, the metric counts it, explain says why
    view = orc.run(run.id).status()
    assert view.needs_attention
    assert "re-published 3 times without a claim" in (view.stuck or "")
    stuck = [a for a in alerted if a.get("event") == "task_stuck"]
    assert [(a["run_id"], a["key"], a["kind"]) for a in stuck] == [(run.id, "x", "republished")]
    assert stuck_metric(orc) == {("republished", "default"): 1.0}
    why = reasons(orc, run.id)
    assert "re-published 3 times without a claim" in why["stuck"], why
    # a fourth re-publish alerts nothing more (flagged once)
    reconciler.run_pass()
    assert len([a for a in alerted if a.get("event") == "task_stuck"]) == 1
    # When a worker finally claims it, the flag clears at the next pass
    token = orc.store.attempts.claim(run.id, "x", state(orc, run.id).attempt, "w:1", 30.0, "t")
    assert token is not None
    reconciler.run_pass()
    assert not orc.run(run.id).status().needs_attention
    assert stuck_metric(orc) == {}


def test_a_task_no_live_worker_registered_waits_ready_until_one_registers(
    orc: Orchestrator, alerted: list[dict[str, Any]]
) -> None:
    store = orc.store
    # Given the only worker registered task "t" only
    store.workers.register("w", default_queues(), 1000, tasks=["t"])
    run = orc.submit(one_task("up"))
    # Then nothing is published for "up": it is held READY, and explain says exactly why
    row = state(orc, run.id)
    assert row.state == "READY", row.state
    queue = row.queue
    assert reasons(orc, run.id)["unregistered"] == (
        f"no live worker on queue {queue} has task up registered (workers on {queue}: w)"
    )
    orc.reconciler.run_pass()
    assert state(orc, run.id).state == "READY"
    assert orc.run(run.id).status().needs_attention
    assert [(a["kind"], a["task_name"], a["queue"]) for a in alerted] == [("unregistered", "up", queue)]
    assert stuck_metric(orc) == {("unregistered", "default"): 1.0}
    # When a worker that has "up" registers, it goes out without anyone acting
    orc.register_worker("w2", default_queues(), 1, ["t", "up"])
    assert state(orc, run.id).state == "QUEUED"
    orc.reconciler.run_pass()
    assert not orc.run(run.id).status().needs_attention


def test_a_message_dropped_as_unregistered_is_held_not_republished(
    orc: Orchestrator, alerted: list[dict[str, Any]]
) -> None:
    store = orc.store
    store.workers.register("old-worker", default_queues(), 1, tasks=["up"])
    run = orc.submit(one_task())
    row = state(orc, run.id)
    assert row.state == "QUEUED"
    # When a worker that lacks the task receives its message (Celery's task_unknown)
    assert store.workers.drop(store.ledger, run.id, "x", row.attempt, "old-worker", "t")
    # Then it is held READY: no admission or reconciler pass publishes it again
    for _ in range(3):
        assert orc.store.admission.admit_ready(100) == []
        orc.reconciler.run_pass()
    assert state(orc, run.id).state == "READY"
    assert republishes(orc, run.id) == 0
    assert orc.run(run.id).status().needs_attention
    assert "dropped by worker old-worker" in reasons(orc, run.id)["unregistered"]
    assert [a["kind"] for a in alerted] == ["unregistered"]
    # When a worker of its queue that has it registers, it is admitted again
    orc.register_worker("new-worker", default_queues(), 1, ["t"])
    row = state(orc, run.id)
    assert row.state == "QUEUED"
    # When the worker that lacks it takes its message again while new-worker has it (a queue whose
    # workers differ), it is READY again for new-worker: never held while a live worker can take it
    for _ in range(MAX_DROPS_BEFORE_HOLD - 1):
        assert store.workers.drop(store.ledger, run.id, "x", row.attempt, "old-worker", "t")
        assert "READY again for the workers of its queue that have it (new-worker)" in last_reason(orc, run.id)
        assert len(orc.store.admission.admit_ready(100)) == 1
        row = state(orc, run.id)
        assert row.state == "QUEUED"
    # but past MAX_DROPS_BEFORE_HOLD drops of one attempt it is held, and released when that worker goes away
    assert store.workers.drop(store.ledger, run.id, "x", row.attempt, "old-worker", "t")
    assert orc.store.admission.admit_ready(100) == []
    orc.unregister_worker("old-worker")
    assert len(orc.store.admission.admit_ready(100)) == 1


def last_reason(orc: Orchestrator, run_id: str) -> str:
    with orc.store.engine.connect() as conn:
        return str(
            conn.execute(
                sa.select(ev.c.reason).where(ev.c.run_id == run_id, ev.c.accepted).order_by(ev.c.id.desc()).limit(1)
            ).scalar_one()
        )


def test_a_run_with_no_transition_while_waiting_on_nothing_named_is_flagged(pg_clean: str) -> None:
    orc = orchestrator(pg_clean, stuck_run_seconds=1.0, dispatch_timeout=3600.0)
    try:
        # Given a task QUEUED whose message nobody takes (the dispatch timeout is far away)
        run = orc.submit(one_task())
        assert state(orc, run.id).state == "QUEUED"
        orc.reconciler.run_pass()
        assert not orc.run(run.id).status().needs_attention
        # When a second of database time passes without a transition of the run
        with orc.store.engine.connect() as conn:
            (last,) = conn.execute(sa.select(sa.func.max(ev.c.at)).where(ev.c.run_id == run.id)).one()
        later = sa.text("SELECT now() > :at + interval '1.2 seconds'").bindparams(at=last)
        deadline = time.monotonic() + 30
        while not sql_now(orc, later):
            assert time.monotonic() < deadline, "the database's clock did not move"
            time.sleep(0.05)
        # a reconciler reads the idle runs at its first pass, then every WATCH_EVERY seconds
        Reconciler(orc.store, orc.publisher, orc.settings).run_pass()
        # Then the run is flagged idle; a transition clears it
        view = orc.run(run.id).status()
        assert view.needs_attention and "no transition for 1s" in (view.stuck or ""), view.stuck
        assert "idle" in reasons(orc, run.id)["stuck"]
        assert orc.store.attempts.claim(run.id, "x", 1, "w:1", 30.0, "t") is not None
        orc.reconciler.run_pass()
        assert not orc.run(run.id).status().needs_attention
    finally:
        orc.store.attempts.hot.close()
        orc.store.dispose()


def test_a_worker_past_its_ttl_registers_its_names_again(orc: Orchestrator) -> None:
    store, wt = orc.store, s.worker_tasks
    orc.register_worker("slow", ["q1"], 1, ["t"])
    with store.engine.begin() as conn:
        stale = sa.text("now() - interval '1 hour'")
        conn.execute(s.workers.update().where(s.workers.c.name == "slow").values(seen_at=stale))
    store.workers.prune()  # the reconciler: its names go with its liveness
    names = lambda: sql_rows(orc, sa.select(wt.c.queue, wt.c.task_name).where(wt.c.worker == "slow"))  # noqa: E731
    assert names() == []
    # its next registry heartbeat registers it again, with its names (never as a worker that says nothing)
    orc.touch_worker("slow", ["q1"], 1, ["t"])
    assert names() == [("q1", "t")]
    store.workers.prune()
    assert names() == [("q1", "t")]


def sql_rows(orc: Orchestrator, query: Any) -> list[tuple[Any, ...]]:
    with orc.store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(query).all()]
