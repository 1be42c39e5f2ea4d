"""Event triggers: an event of a key (of the trigger's tenant, whose payload contains its match)
starts exactly one run per (trigger, event) with the payload laid over the params, whoever
finishes the firing and however many do; max_active_runs makes later firings wait (never
dropped); a paused trigger records nothing; a refused definition writes nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, DagNotFound, Orchestrator, ValidationError
from orchestrator.services.triggers import TriggerError, TriggerNotFound
from orchestrator.store import schema as s
from tests.store.dynamic import orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def etl(name: str = "etl") -> DAG:
    dag = DAG(name, params={"region": "eu", "n": 1})
    dag.task("extract", "t", kwargs={"day": "{{ ds }}"})
    dag.task("load", "t", upstream=["extract"])
    return dag


def rows(orc: Orchestrator, table: sa.Table) -> list[Any]:
    with orc.store.engine.connect() as conn:
        return list(conn.execute(sa.select(table)).all())


def trigger_runs(orc: Orchestrator, trigger: str | None = None) -> list[Any]:
    query = sa.select(s.runs).where(s.runs.c.trigger.is_not(None)).order_by(s.runs.c.created_at)
    if trigger is not None:
        query = query.where(s.runs.c.trigger == trigger)
    with orc.store.engine.connect() as conn:
        return list(conn.execute(query).all())


def firing_states(orc: Orchestrator, trigger: str) -> list[str]:
    return [f.state for f in sorted(orc.triggers.firings(trigger), key=lambda f: f.event)]


def test_refused_definitions_write_nothing(orc: Orchestrator) -> None:
    bad: list[dict[str, Any]] = [
        {"event": "not a key!", "spec": etl()},
        {"event": "orders.new"},
        {"event": "orders.new", "spec": etl(), "dag": "tasks.dags:daily"},
        {"event": "orders.new", "spec": etl(), "match": ["x"]},
        {"event": "orders.new", "spec": etl(), "max_active_runs": 0},
        {"event": "orders.new", "spec": etl(), "params": [1]},
        {"event": "orders.new", "dag": "builtins:eval"},
        {"event": "orders.new", "registered": "nope"},
    ]
    for kwargs in bad:
        with pytest.raises((ValidationError, DagNotFound)):
            orc.triggers.add("t1", **kwargs)
    unknown = DAG("x")
    unknown.task("a", "no_such_task")
    with pytest.raises(ValidationError):
        orc.triggers.add("t1", event="orders.new", spec=unknown)
    with pytest.raises(TriggerError):
        orc.triggers.add("", event="orders.new", spec=etl())
    assert rows(orc, s.triggers) == []
    with pytest.raises(TriggerNotFound):
        orc.triggers.get("t1")


def test_an_event_starts_one_run_per_trigger_with_the_payload_over_the_params(orc: Orchestrator) -> None:
    first = orc.triggers.add("first", event="orders.new", spec=etl(), params={"n": 2})
    assert (first.event, first.paused, first.what.startswith("spec etl")) == ("orders.new", False, True)
    orc.triggers.add("second", event="orders.new", spec=etl("other"))
    orc.triggers.add("elsewhere", event="orders.old", spec=etl())
    orc.triggers.add("picky", event="orders.new", spec=etl(), match={"region": "us"})
    done = orc.events.emit("orders.new", {"region": "ap", "order": 7}, event_id="e1")
    assert not done.duplicate
    runs = {r.trigger: r for r in trigger_runs(orc)}
    assert set(runs) == {"first", "second"}
    assert runs["first"].params == {"region": "ap", "n": 2, "order": 7}
    assert runs["second"].params == {"region": "ap", "n": 1, "order": 7}
    assert runs["first"].idempotency_key == "on:first:e1" and runs["first"].logical_date is not None
    assert firing_states(orc, "first") == ["fired"] and orc.triggers.firings("picky") == []
    assert orc.triggers.get("first").last_run_id == runs["first"].id
    # the match: a payload that contains it
    orc.events.emit("orders.new", {"region": "us"}, event_id="e2")
    assert len(trigger_runs(orc, "picky")) == 1 and len(trigger_runs(orc)) == 5


def test_a_duplicate_event_id_starts_nothing(orc: Orchestrator) -> None:
    orc.triggers.add("first", event="orders.new", spec=etl())
    orc.events.emit("orders.new", {"a": 1}, event_id="same")
    again = orc.events.emit(
        "orders.new", {"a": 1}, event_id="same"
    )  # the same event again (another payload: a conflict)
    assert again.duplicate
    assert len(trigger_runs(orc)) == 1 and len(orc.triggers.firings("first")) == 1
    assert orc.triggers.tick() == []


def test_finishers_racing_make_one_run(orc: Orchestrator) -> None:
    orc.triggers.add("first", event="orders.new", spec=etl())
    # the store's emit writes the event and its firing, and finishes nothing (an emitter that died)
    done = orc.store.waits.emit("default", "orders.new", '{"x": 1}', "e1", None, "test", 10)
    assert firing_states(orc, "first") == ["pending"] and trigger_runs(orc) == []
    barrier = threading.Barrier(4)
    out: list[Any] = []

    def finisher() -> None:
        barrier.wait()
        out.extend(orc.triggers.finish(done.id))

    threads = [threading.Thread(target=finisher) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(trigger_runs(orc)) == 1 and firing_states(orc, "first") == ["fired"]
    assert sorted(str(f.state) for f in out) == ["None", "None", "None", "fired"]
    assert orc.triggers.finish(done.id) == [] and orc.triggers.tick() == []
    assert len(trigger_runs(orc)) == 1


def test_a_pending_firing_is_finished_by_the_next_pass(orc: Orchestrator) -> None:
    orc.triggers.add("first", event="orders.new", spec=etl())
    orc.store.waits.emit("default", "orders.new", "{}", "e1", None, "test", 10)
    fired = orc.triggers.tick()
    assert [(f.trigger, f.state) for f in fired] == [("first", "fired")]
    assert len(trigger_runs(orc)) == 1


def test_max_active_runs_makes_later_firings_wait_then_fire_in_order(orc: Orchestrator) -> None:
    orc.triggers.add("one", event="orders.new", spec=etl(), max_active_runs=1)
    orc.events.emit("orders.new", {"n": 1}, event_id="e1")
    orc.events.emit("orders.new", {"n": 2}, event_id="e2")
    orc.events.emit("orders.new", {"n": 3}, event_id="e3")
    assert firing_states(orc, "one") == ["fired", "waiting", "waiting"]
    assert orc.triggers.tick() and firing_states(orc, "one") == ["fired", "waiting", "waiting"]
    first = trigger_runs(orc)[0]
    orc.cancel(first.id)
    orc.triggers.tick()
    assert firing_states(orc, "one") == ["fired", "fired", "waiting"]
    assert [r.params["n"] for r in trigger_runs(orc)] == [1, 2]
    orc.cancel(trigger_runs(orc)[1].id)
    assert orc.reconcile()["trigger_firings"] == 1  # a worker's reconciler does it too: no beat needed
    assert firing_states(orc, "one") == ["fired", "fired", "fired"]
    assert [r.params["n"] for r in trigger_runs(orc)] == [1, 2, 3]


def test_a_paused_trigger_ignores_events(orc: Orchestrator) -> None:
    orc.triggers.add("first", event="orders.new", spec=etl())
    assert orc.triggers.pause("first").paused
    orc.events.emit("orders.new", {}, event_id="e1")
    assert trigger_runs(orc) == [] and orc.triggers.firings("first") == []
    assert orc.triggers.add("first", event="orders.new", spec=etl()).paused  # a replaced trigger keeps its flag
    assert not orc.triggers.resume("first").paused
    orc.events.emit("orders.new", {}, event_id="e2")
    assert len(trigger_runs(orc)) == 1
    assert orc.triggers.tick() == []  # e1 is not replayed


def test_another_tenants_event_or_a_signal_does_not_fire_it(orc: Orchestrator) -> None:
    orc.triggers.add("first", event="orders.new", spec=etl())
    orc.events.emit("orders.new", {}, event_id="e1", tenant="acme")
    assert trigger_runs(orc) == [] and rows(orc, s.trigger_firings) == []
    run = orc.submit(etl("plain"))
    orc.events.signal(run.id, "orders.new", {})
    assert trigger_runs(orc) == [] and rows(orc, s.trigger_firings) == []


def test_a_firing_that_cannot_build_fails_and_is_recorded(orc: Orchestrator) -> None:
    orc.triggers.add("first", event="orders.new", spec=etl())
    with orc.store.engine.begin() as conn:  # the snapshot no longer validates (a task gone)
        spec = etl().to_spec()
        spec["nodes"][0]["task"] = "gone"
        conn.execute(s.triggers.update().values(spec=spec))
    orc.events.emit("orders.new", {}, event_id="e1")
    assert firing_states(orc, "first") == ["failed"] and trigger_runs(orc) == []
    assert "gone" in (orc.triggers.get("first").last_error or "")


def test_remove_deletes_the_trigger_and_its_firings(orc: Orchestrator) -> None:
    orc.triggers.add("first", event="orders.new", spec=etl())
    orc.events.emit("orders.new", {}, event_id="e1")
    orc.triggers.remove("first")
    assert rows(orc, s.triggers) == [] and rows(orc, s.trigger_firings) == []
    assert len(trigger_runs(orc)) == 1  # its runs stay
    with pytest.raises(TriggerNotFound):
        orc.triggers.remove("first")


def test_beats_pass_finishes_open_firings(orc: Orchestrator) -> None:
    from orchestrator.runtime.beat import DatabaseScheduler

    orc.triggers.add("first", event="orders.new", spec=etl())
    orc.store.waits.emit("default", "orders.new", "{}", "e1", None, "test", 10)  # its emitter died
    beat = DatabaseScheduler.__new__(DatabaseScheduler)  # the pass alone, without a Celery app
    beat._orc = orc
    assert beat.tick() > 0
    assert firing_states(orc, "first") == ["fired"] and len(trigger_runs(orc)) == 1
