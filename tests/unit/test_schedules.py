"""Schedules through the Python API, on the embedded default (SQLite) and on Postgres: adding
refuses bad input with a named error and writes nothing; the scheduler's pass fires what is due
by the database clock, once per instant, with the catch-up and overlap policies; a broken
schedule records its error and raises the alert without stopping the others; pause, resume,
trigger and backfill. Real beat processes: tests/fault/test_beat.py."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, FactoryNotAllowed, Orchestrator, RunState, ValidationError, dag_factory
from orchestrator.core.cron import ScheduleError
from orchestrator.core.firing import RECORD_SKIPPED
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.schedules import CANCEL_PREVIOUS, ScheduleNotFound
from orchestrator.services.alerts import schedule_failed
from orchestrator.store import schema as s
from orchestrator.store.schedules import iso
from tests.conftest import backend_orchestrator

TASKS = ["tasks.probes.noop", "tasks.etl.extract_orders"]
HERE = "tests.unit.test_schedules"
#: the factory modules of these tests (the deployment's default is tasks.dags alone)
FACTORY_MODULES = ("tasks.dags", "tests.factories", HERE)


@dag_factory
def by_params(logical_date: dt.datetime, params: dict[str, Any]) -> DAG:
    """A factory (``tests.unit.test_schedules:by_params``) whose DAG the params shape: ``task``
    (default the no-op probe), ``tenant`` (default none: ``default``)."""
    dag = DAG("by-params", tenant=str(params.get("tenant", "default")))
    dag.task("only", str(params.get("task", "tasks.probes.noop")))
    return dag


@pytest.fixture(params=["postgres"])
def orc(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Orchestrator]:
    base = backend_orchestrator(request, str(tmp_path), TASKS)
    assert isinstance(base, Orchestrator)
    base.store.dispose()
    # every-second schedules below: no minimum interval (its own test sets one)
    settings = dataclasses.replace(base.settings, dag_factory_modules=FACTORY_MODULES, schedule_min_interval_seconds=0)
    o = Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(TASKS))
    yield o
    o.store.dispose()


def bound(orc: Orchestrator, tenant: str, **settings: Any) -> Orchestrator:
    """An orchestrator of the same deployment acting as ``tenant``."""
    return Orchestrator(
        dataclasses.replace(orc.settings, **settings),
        publisher=RecordingPublisher(),
        registry=StaticRegistry(TASKS),
        tenant=tenant,
    )


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "report.yaml"
    path.write_text(
        "name: report\nnodes:\n"
        "  - {key: a, task: tasks.etl.extract_orders, kwargs: {day: '{{ ds }}', at: '{{ logical_date }}'}}\n"
    )
    return path


def rewind(orc: Orchestrator, name: str, seconds: float) -> None:
    """As if the schedule had last decided an instant ``seconds`` ago (beat was down since)."""
    now = orc.store.schedule_rows.now()
    with orc.store.engine.begin() as conn:
        conn.execute(
            s.schedules.update()
            .where(s.schedules.c.name == name)
            .values(last_at=now - dt.timedelta(seconds=seconds), next_at=now - dt.timedelta(seconds=seconds - 1))
        )


def next_tick(orc: Orchestrator, name: str) -> None:
    """Wait until the schedule's next instant has passed on the database clock, then run a pass."""
    import time

    due = orc.schedules.get(name).next_at
    while orc.store.schedule_rows.now() < due:
        time.sleep(0.05)
    orc.schedules.tick()


def runs_of(orc: Orchestrator, name: str) -> list[Any]:
    with orc.store.engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(s.runs.c.id, s.runs.c.logical_date, s.runs.c.state)
                .where(s.runs.c.schedule == name)
                .order_by(s.runs.c.logical_date)
            ).all()
        )


def firings(orc: Orchestrator, name: str) -> list[Any]:
    return sorted(orc.store.schedule_rows.firings(name, 1000), key=lambda f: str(f.logical_date))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"cron": "61 * * * *"}, ScheduleError, "not valid"),
        ({"cron": "* * * * *", "tz": "Nowhere/City"}, ScheduleError, "unknown time zone"),
        ({"every": 60, "spec": "missing.yaml"}, ScheduleError, "does not exist"),
        ({"every": 60, "spec": None, "dag": "tests.factories.nope:fn"}, ScheduleError, "cannot import"),
        ({"every": 60, "spec": None, "dag": "tests.factories:nothing"}, ScheduleError, "has no function"),
        ({"every": 60, "spec": None, "dag": "tests.factories"}, ScheduleError, "module:function"),
        ({"every": 60, "dst_fold": "twice"}, ScheduleError, "dst_fold must be one of"),
        ({"every": 60, "catchup": "some"}, ScheduleError, "catchup must be one of"),
        ({"every": 60, "overlap": "queue"}, ScheduleError, "overlap must be one of"),
        ({"every": 60, "params": [1]}, ScheduleError, "params must be a mapping"),
    ],
)
def test_add_refuses_bad_schedules_and_writes_nothing(
    orc: Orchestrator, spec: Path, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    kwargs = {"spec": str(spec), **kwargs}
    with pytest.raises(error, match=message):
        orc.schedules.add("bad", **kwargs)
    assert orc.schedules.all() == []


def test_add_refuses_a_spec_that_would_not_submit(orc: Orchestrator, tmp_path: Path) -> None:
    unknown = tmp_path / "u.yaml"
    unknown.write_text("name: u\nnodes:\n  - {key: a, task: tasks.nope}\n")
    with pytest.raises(ValidationError, match="not registered"):
        orc.schedules.add("u", every=60, spec=str(unknown))
    templated = tmp_path / "t.yaml"
    templated.write_text("name: t\nnodes:\n  - {key: a, task: tasks.probes.noop, kwargs: {x: '{{ run_id }}'}}\n")
    with pytest.raises(ScheduleError, match=r"unknown placeholder '\{\{ run_id \}\}'"):
        orc.schedules.add("t", every=60, spec=str(templated))
    assert orc.schedules.all() == []


def test_a_due_schedule_fires_once_per_instant_with_its_logical_date(orc: Orchestrator, spec: Path) -> None:
    added = orc.schedules.add("report", cron="0 * * * *", tz="America/New_York", spec=str(spec))
    assert added.next_at > orc.store.schedule_rows.now() and added.spec_hash and len(added.spec_hash) == 64
    assert orc.schedules.tick() > 0 and runs_of(orc, "report") == []  # nothing due yet
    # beat was down for three instants: its last decision a second after the top of the hour three
    # hours ago (a fixed 3 h + 60 s spans four instants in the first minute of an hour)
    now = orc.store.schedule_rows.now()
    rewind(orc, "report", 3600 * 3 + now.minute * 60 + now.second + now.microsecond / 1e6 - 1)
    orc.schedules.tick()
    orc.schedules.tick()  # a second pass (or a second beat) finds nothing more to do
    (run,) = runs_of(orc, "report")
    fired = [f for f in firings(orc, "report") if f.state == "fired"]
    skipped = [f for f in firings(orc, "report") if f.state == "skipped"]
    assert len(fired) == 1 and len(skipped) == 2  # catch-up latest: the most recent one runs
    assert all("missed" in f.reason for f in skipped)
    assert run.logical_date == iso(fired[0].logical_date.replace(tzinfo=dt.UTC))
    task = orc.run(run.id).task("a")
    local = dt.datetime.fromisoformat(run.logical_date).astimezone(__import__("zoneinfo").ZoneInfo("America/New_York"))
    assert task.kwargs == {"day": local.date().isoformat(), "at": run.logical_date}
    view = orc.schedules.get("report").to_json()
    assert view["last_run"] == run.id and view["last_error"] is None and view["next_fire"] > run.logical_date


def test_catchup_all_fires_every_missed_instant_up_to_the_bound(orc: Orchestrator, spec: Path) -> None:
    orc.schedules.add("every", every=60, spec=str(spec), catchup="all", max_catchup=3)
    rewind(orc, "every", 5 * 60 + 30)
    orc.schedules.tick()
    assert len(runs_of(orc, "every")) == 3
    states = [f.state for f in firings(orc, "every")]  # 5 or 6 minute marks in 5.5 minutes
    assert states.count("fired") == 3 and states.count("skipped") == len(states) - 3 >= 2


def test_overlap_skip_and_cancel_previous(orc: Orchestrator, spec: Path) -> None:
    # no worker: every run stays RUNNING
    orc.schedules.add("skipper", every=1, spec=str(spec), overlap="skip")
    next_tick(orc, "skipper")
    next_tick(orc, "skipper")
    assert len(runs_of(orc, "skipper")) == 1
    assert any("overlap skip" in (f.reason or "") for f in firings(orc, "skipper"))
    orc.schedules.add("canceller", every=1, spec=str(spec), overlap="cancel_previous")
    next_tick(orc, "canceller")
    next_tick(orc, "canceller")
    first, second = runs_of(orc, "canceller")[-2:]
    assert (first.state, second.state) == (RunState.CANCELLED.value, RunState.RUNNING.value)


def test_buffer_one_fires_the_buffered_instant_when_the_previous_run_ends(orc: Orchestrator, spec: Path) -> None:
    orc.schedules.add("buffered", every=1, spec=str(spec), overlap="buffer_one")
    next_tick(orc, "buffered")
    (first,) = runs_of(orc, "buffered")
    next_tick(orc, "buffered")
    assert len(runs_of(orc, "buffered")) == 1 and orc.schedules.get("buffered").buffered_at is not None
    orc.cancel(first.id)
    orc.schedules.tick()
    assert len(runs_of(orc, "buffered")) == 2 and orc.schedules.get("buffered").buffered_at is None
    assert [f.kind for f in firings(orc, "buffered") if f.state == "fired"] == ["scheduled", "buffered"]


def test_max_active_runs_skips_beyond_the_bound(orc: Orchestrator, spec: Path) -> None:
    orc.schedules.add("capped", every=1, spec=str(spec), max_active_runs=2)
    for _ in range(3):
        next_tick(orc, "capped")
    assert len(runs_of(orc, "capped")) == 2
    assert any("max_active_runs 2 reached" in (f.reason or "") for f in firings(orc, "capped"))


def test_a_broken_schedule_records_its_error_alerts_and_never_stops_the_others(orc: Orchestrator, spec: Path) -> None:
    alerts: list[dict[str, Any]] = []

    def receiver(sender: Any = None, alert: Any = None, **_: Any) -> None:
        alerts.append(alert)

    schedule_failed.connect(receiver, weak=False)
    try:
        orc.schedules.add("broken", every=60, dag="tests.factories:broken")
        orc.schedules.add("wrong", every=60, dag="tests.factories:not_a_dag")
        orc.schedules.add("fine", every=60, spec=str(spec))
        for name in ("broken", "wrong", "fine"):
            rewind(orc, name, 61)
        orc.schedules.tick()
    finally:
        schedule_failed.disconnect(receiver)
    assert len(runs_of(orc, "fine")) == 1 and runs_of(orc, "broken") == [] and runs_of(orc, "wrong") == []
    broken = orc.schedules.get("broken")
    assert "RuntimeError: the warehouse is gone" in (broken.last_error or "")
    assert "returned int, not a DAG" in (orc.schedules.get("wrong").last_error or "")
    assert {a["schedule"] for a in alerts} == {"broken", "wrong"}
    assert [f.state for f in firings(orc, "broken")] == ["failed"]
    # the next instant is tried again (and fails again, recorded)
    assert broken.next_at > orc.store.schedule_rows.now() - dt.timedelta(seconds=1)


def test_pause_resume_and_trigger(orc: Orchestrator, spec: Path) -> None:
    orc.schedules.add("p", every=60, spec=str(spec))
    orc.schedules.pause("p")
    rewind(orc, "p", 3 * 60 + 5)
    orc.schedules.tick()
    assert runs_of(orc, "p") == []
    manual = orc.schedules.trigger("p")  # paused or not
    assert manual.created and manual.run_id is not None
    orc.schedules.resume("p")
    orc.schedules.tick()
    assert len(runs_of(orc, "p")) == 2  # the manual one, and the latest missed instant
    assert [f.kind for f in firings(orc, "p") if f.state == "fired"].count("manual") == 1
    with pytest.raises(ScheduleNotFound):
        orc.schedules.pause("nope")


def test_backfill_is_idempotent_with_firing_and_with_itself(orc: Orchestrator, spec: Path) -> None:
    orc.schedules.add("daily", cron="30 2 * * *", tz="America/New_York", spec=str(spec))
    start = dt.datetime(2026, 3, 6, tzinfo=dt.UTC)
    end = dt.datetime(2026, 3, 10, tzinfo=dt.UTC)
    dates = orc.schedules.backfill_dates("daily", start, end)
    assert [iso(d) for d in dates] == [
        "2026-03-06T07:30:00+00:00",
        "2026-03-07T07:30:00+00:00",
        "2026-03-08T07:30:00+00:00",
        "2026-03-09T06:30:00+00:00",
    ]
    # at most 2 running at once: no worker here, so the third waits until the timeout
    with pytest.raises(TimeoutError):
        list(orc.schedules.backfill("daily", start, end, max_active=2, poll=0.05, timeout=0.5))
    assert len(runs_of(orc, "daily")) == 2
    for run in runs_of(orc, "daily"):
        orc.cancel(run.id)
    outcomes = list(orc.schedules.backfill("daily", start, end, max_active=4))
    assert [o.created for o in outcomes] == [False, False, True, True]
    assert len(runs_of(orc, "daily")) == 4
    again = list(orc.schedules.backfill("daily", start, end, max_active=4))
    assert not any(o.created for o in again) and len(runs_of(orc, "daily")) == 4


def test_two_schedulers_at_once_fire_each_instant_once(orc: Orchestrator, spec: Path) -> None:
    began = time.monotonic()
    for i in range(4):
        orc.schedules.add(f"s{i}", every=60, spec=str(spec), catchup="all", max_catchup=5)
        rewind(orc, f"s{i}", 5 * 60 + 30)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(3):
                orc.schedules.tick()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # five instants were due at the rewind; a loaded machine may let a sixth come due before a pass
    later = int(time.monotonic() - began) // 60 + 1
    for i in range(4):
        got = runs_of(orc, f"s{i}")
        assert 5 <= len(got) <= 5 + later and len({r.logical_date for r in got}) == len(got)


def test_apply_upserts_a_file_of_schedules_and_checks_all_first(orc: Orchestrator, spec: Path, tmp_path: Path) -> None:
    good = tmp_path / "schedules.yaml"
    good.write_text(
        "schedules:\n"
        f"  - {{name: hourly, cron: '0 * * * *', tz: Europe/London, spec: {spec.name}}}\n"
        "  - {name: poll, every: 300, dag: 'tests.factories:probe', params: {name: poll}}\n"
    )
    assert [x.name for x in orc.schedules.apply(good)] == ["hourly", "poll"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "schedules:\n"
        f"  - {{name: new-one, every: 60, spec: {spec.name}}}\n"
        "  - {name: broken, cron: 'nope', spec: x.yaml}\n"
    )
    with pytest.raises(ScheduleError):
        orc.schedules.apply(bad)
    assert sorted(x.name for x in orc.schedules.all()) == ["hourly", "poll"]  # nothing of bad.yaml


def test_a_tenant_bound_orchestrator_sees_its_own_schedules(orc: Orchestrator, spec: Path) -> None:
    orc.schedules.add("shared", every=60, spec=str(spec))
    acme = bound(orc, "acme")
    try:
        acme.schedules.add("mine", every=60, spec=str(spec))
        assert [x.name for x in acme.schedules.all()] == ["mine"] and acme.schedules.get("mine").tenant == "acme"
        with pytest.raises(ScheduleNotFound):
            acme.schedules.pause("shared")
        # names are per tenant: acme's "shared" is its own schedule, the default tenant's is untouched
        assert acme.schedules.add("shared", every=30, spec=str(spec)).tenant == "acme"
        mine = orc.store.schedule_rows.scoped("default").get("shared")
        assert mine.every_seconds == 60 and mine.tenant == "default"
    finally:
        acme.store.dispose()


def test_a_schedule_runs_a_dag_object_declared_in_code(orc: Orchestrator) -> None:
    dag = DAG("in-code")
    dag.task("a", "tasks.probes.noop", kwargs={"when": "{{ logical_date }}"})
    orc.schedules.add("code", every=60, spec=dag)
    rewind(orc, "code", 61)
    orc.schedules.tick()
    (run,) = runs_of(orc, "code")
    assert orc.run(run.id).task("a").kwargs == {"when": run.logical_date}


# ---------------------------------------------------------------------------- review fixes


def run_rows(orc: Orchestrator, name: str) -> list[Any]:
    with orc.store.engine.connect() as conn:
        return list(conn.execute(sa.select(s.runs).where(s.runs.c.schedule == name)).all())


def test_a_factorys_runs_are_the_schedules_tenant(orc: Orchestrator) -> None:
    """A factory schedule added by a tenant-bound orchestrator fires, from beat (unbound), runs
    of that tenant; a DAG the factory builds for another tenant is a failed firing."""
    acme = bound(orc, "acme")
    try:
        acme.schedules.add("mine", every=60, dag=f"{HERE}:by_params")
        acme.schedules.add("escape", every=60, dag=f"{HERE}:by_params", params={"tenant": "beta"})
    finally:
        acme.store.dispose()
    for name in ("mine", "escape"):
        rewind(orc, name, 61)
    orc.schedules.tick()  # beat: an unbound orchestrator
    assert [r.tenant for r in run_rows(orc, "mine")] == ["acme"]
    assert run_rows(orc, "escape") == []
    (failed,) = firings(orc, "escape")
    assert failed.state == "failed" and "tenant 'beta'" in failed.reason and "tenant 'acme'" in failed.reason


def test_a_factorys_dag_is_checked_at_firing(orc: Orchestrator) -> None:
    orc.schedules.add("unknown", every=60, dag=f"{HERE}:by_params", params={"task": "tasks.nope"})
    rewind(orc, "unknown", 61)
    orc.schedules.tick()
    assert run_rows(orc, "unknown") == []
    (failed,) = firings(orc, "unknown")
    assert failed.state == "failed" and "not registered" in failed.reason
    assert "not registered" in (orc.schedules.get("unknown").last_error or "")


def test_submit_with_a_schedule_is_the_schedules_own(orc: Orchestrator, spec: Path) -> None:
    """``submit(schedule=...)`` creates a schedule's run only for an existing schedule of the
    run's tenant, with a logical date; a bound orchestrator cannot plant a run in another
    tenant's schedule."""
    orc.schedules.add("shared", every=60, spec=str(spec))
    dag = DAG("planted")
    dag.task("a", "tasks.probes.noop")
    at = "2026-01-01T00:00:00+00:00"
    with pytest.raises(ValidationError, match="no schedule named 'nope'"):
        orc.submit(dag, schedule="nope", logical_date=at)
    with pytest.raises(ValidationError, match="needs its logical_date"):
        orc.submit(dag, schedule="shared")
    acme = bound(orc, "acme")
    try:
        with pytest.raises(ValidationError, match="no schedule named 'shared' for tenant 'acme'"):
            acme.submit(dag, schedule="shared", logical_date=at)
    finally:
        acme.store.dispose()
    assert run_rows(orc, "shared") == []
    assert orc.submit(dag, schedule="shared", logical_date=at).id  # its own tenant's: a backfill by hand


def test_a_schedule_name_used_again_by_another_tenant_never_sees_the_old_runs(orc: Orchestrator, spec: Path) -> None:
    """The (schedule, logical date) run lookups are the schedule's tenant's: a schedule removed
    and added again by another tenant neither reports nor counts nor cancels the old runs."""
    orc.schedules.add("reused", cron="30 2 * * *", tz="America/New_York", spec=str(spec))
    start, end = dt.datetime(2026, 3, 6, tzinfo=dt.UTC), dt.datetime(2026, 3, 8, tzinfo=dt.UTC)
    old = [f.run_id for f in orc.schedules.backfill("reused", start, end)]
    assert len(old) == 2 and all(old)
    orc.schedules.remove("reused")
    acme = bound(orc, "acme")
    try:
        acme.schedules.add(
            "reused", cron="30 2 * * *", tz="America/New_York", spec=str(spec), overlap="cancel_previous"
        )
        assert acme.schedules.get("reused").last_run_id is None
        again = list(acme.schedules.backfill("reused", start, end, max_active=2, timeout=5))
    finally:
        acme.store.dispose()
    # acme's schedule makes runs of its own for the same instants; the old ones are not its
    assert all(f.created and f.run_id and f.run_id not in old for f in again) and len(again) == 2
    old_rows = [r for r in run_rows(orc, "reused") if r.tenant == "default"]
    assert [r.state for r in old_rows] == [RunState.RUNNING.value] * 2  # nothing cancelled


def test_cancel_previous_cancels_nothing_when_the_new_dag_does_not_build(orc: Orchestrator) -> None:
    orc.schedules.add("canceller", every=1, dag=f"{HERE}:by_params", overlap="cancel_previous")
    next_tick(orc, "canceller")
    (first,) = runs_of(orc, "canceller")
    # the same timing, another DAG: one that will not submit (its place is kept)
    orc.schedules.add(
        "canceller", every=1, dag=f"{HERE}:by_params", params={"task": "tasks.nope"}, overlap="cancel_previous"
    )
    next_tick(orc, "canceller")
    assert [(r.id, r.state) for r in runs_of(orc, "canceller")] == [(first.id, RunState.RUNNING.value)]
    assert [f.state for f in firings(orc, "canceller")][-1] == "failed"


def test_a_pending_cancel_previous_firing_finished_by_another_beat_still_cancels(
    orc: Orchestrator, spec: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A beat that dies after deciding a cancel_previous instant (its firing left pending):
    the beat that finishes the firing cancels the running runs too."""
    orc.schedules.add("canceller", every=1, spec=str(spec), overlap="cancel_previous")
    next_tick(orc, "canceller")
    (first,) = runs_of(orc, "canceller")

    def dies(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt("the beat is killed")

    monkeypatch.setattr(orc.schedules, "_fire_one", dies)
    with pytest.raises(KeyboardInterrupt):
        next_tick(orc, "canceller")
    monkeypatch.undo()
    (pending,) = [f for f in firings(orc, "canceller") if f.state == "pending"]
    assert pending.reason == CANCEL_PREVIOUS
    with orc.store.engine.begin() as conn:  # long enough ago for any beat to take it over
        conn.execute(s.firings.update().where(s.firings.c.state == "pending").values(at=dt.datetime(2020, 1, 1)))
    orc.schedules.pause("canceller")  # only the pending firing is left to do
    orc.schedules.tick()
    states = {r.logical_date: r.state for r in runs_of(orc, "canceller")}
    assert states[first.logical_date] == RunState.CANCELLED.value
    assert states[iso(pending.logical_date.replace(tzinfo=dt.UTC))] == RunState.RUNNING.value


def test_catch_up_records_a_bounded_number_of_skipped_instants(orc: Orchestrator, spec: Path) -> None:
    """Two days missed of an every-minute schedule (2,880 instants): the newest skipped ones are
    recorded one by one, the older ones by one summary firing that counts them."""
    orc.schedules.add("minutely", every=60, spec=str(spec))
    rewind(orc, "minutely", 2 * 86400 + 30)
    orc.schedules.tick()
    found = firings(orc, "minutely")
    fired = [f for f in found if f.state == "fired"]
    skipped = [f for f in found if f.state == "skipped"]
    assert len(fired) == 1 and len(runs_of(orc, "minutely")) == 1
    assert len(skipped) == RECORD_SKIPPED + 1, len(skipped)
    summary = skipped[0]  # the oldest instant stands for the older ones
    counted = re.search(r"(\d+) in all, not recorded one by one", summary.reason)
    # 2,880 or 2,881 minute marks in two days and 30 s: one fired, RECORD_SKIPPED recorded
    assert counted is not None and int(counted.group(1)) in (2880 - 1 - RECORD_SKIPPED, 2881 - 1 - RECORD_SKIPPED)
    assert all("missed" in f.reason for f in skipped)


def test_catch_up_after_a_year_is_quick(orc: Orchestrator, spec: Path) -> None:
    import time

    orc.schedules.add("cron-minutely", cron="* * * * *", spec=str(spec), catchup="all", max_catchup=3)
    orc.schedules.add("every-second", every=1, spec=str(spec))
    began = time.monotonic()
    for name in ("cron-minutely", "every-second"):
        rewind(orc, name, 366 * 86400)
    # quick: the pass counts a year of instants without walking them one by one (no wall-clock
    # bound here, which a loaded machine breaks; the suite's timeout catches a walk)
    orc.schedules.tick()
    # the database's clock moves on between the rewind and the pass: as many more instants
    slack = 1 + int(time.monotonic() - began)
    assert len(runs_of(orc, "cron-minutely")) == 3 and len(runs_of(orc, "every-second")) == 1
    summary = firings(orc, "cron-minutely")[0]
    assert "at least 10000 in all" in summary.reason
    summary = firings(orc, "every-second")[0]
    counted = re.search(r"(\d+) in all", summary.reason)
    assert counted is not None and abs(int(counted.group(1)) - (366 * 86400 - 1 - RECORD_SKIPPED)) <= slack
    assert len(firings(orc, "every-second")) == RECORD_SKIPPED + 2


def test_one_schedules_error_never_stops_the_pass(orc: Orchestrator, spec: Path) -> None:
    """A schedule whose row makes its pass fail (here: a last instant in the year 9999, written
    by hand) records the error and is left until its next instant; the others fire."""
    alerts: list[dict[str, Any]] = []

    def receiver(sender: Any = None, alert: Any = None, **_: Any) -> None:
        alerts.append(alert)

    orc.schedules.add("aaa-corrupt", every=60, spec=str(spec))
    orc.schedules.add("fine", every=60, spec=str(spec))
    rewind(orc, "fine", 61)
    rewind(orc, "aaa-corrupt", 3600)  # the earliest next instant: decided first
    with orc.store.engine.begin() as conn:
        corrupt = s.schedules.c.name == "aaa-corrupt"
        conn.execute(s.schedules.update().where(corrupt).values(last_at=dt.datetime(9999, 12, 31, tzinfo=dt.UTC)))
    schedule_failed.connect(receiver, weak=False)
    try:
        wait = orc.schedules.tick()
        again = orc.schedules.tick()
        # the broken one does not spin beat: each pass waits for the fine one's next instant, not
        # for the broken one (whose instant stays past); a pass near a minute's end may find that
        # instant less than a second away (every=60 instants fall on the minute)
        ahead = (orc.schedules.get("fine").next_at - orc.store.schedule_rows.now()).total_seconds()
        least = min(ahead, 0.5) - 0.05
        assert ahead > 0 and wait > least and again > least, (wait, again, ahead)
    finally:
        schedule_failed.disconnect(receiver)
    assert len(runs_of(orc, "fine")) == 1
    assert "OverflowError" in (orc.schedules.get("aaa-corrupt").last_error or "")
    assert [a["schedule"] for a in alerts] == ["aaa-corrupt"]  # once: not again at the next pass


def test_two_writers_of_one_firing_never_fail(orc: Orchestrator, spec: Path) -> None:
    """The firing insert is insert-if-absent: a writer that finds the instant written by a
    concurrent one (committed while it waited) leaves it, no integrity error."""
    orc.schedules.add("raced", every=60, spec=str(spec))
    rows = orc.store.schedule_rows.scoped("default")
    at = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    results: list[Any] = []
    first_conn = orc.store.engine.connect()
    tx = first_conn.begin()
    assert rows.record(first_conn, "raced", at, "pending", "scheduled", overwrite=False)

    def other() -> None:
        try:
            with orc.store.engine.begin() as conn:
                results.append(rows.record(conn, "raced", at, "skipped", "catchup", reason="x", overwrite=False))
        except Exception as exc:  # noqa: BLE001 - reported below
            results.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join(0.5)  # Postgres: it waits on the first writer's row; SQLite: on the write lock
    tx.commit()
    first_conn.close()
    thread.join(10)
    assert results == [False]
    (only,) = firings(orc, "raced")
    assert only.state == "pending"


def test_apply_keeps_a_paused_schedule_paused(orc: Orchestrator, spec: Path, tmp_path: Path) -> None:
    path = tmp_path / "schedules.yaml"
    path.write_text(f"schedules:\n  - {{name: nightly, cron: '0 2 * * *', spec: {spec.name}}}\n")
    orc.schedules.apply(path)
    orc.schedules.pause("nightly")
    (again,) = orc.schedules.apply(path)  # the file says nothing of pausing: the flag stays
    assert again.paused
    path.write_text(f"schedules:\n  - {{name: nightly, cron: '0 2 * * *', spec: {spec.name}, paused: false}}\n")
    assert not orc.schedules.apply(path)[0].paused
    path.write_text(f"schedules:\n  - {{name: nightly, cron: '0 2 * * *', spec: {spec.name}, paused: 'no'}}\n")
    with pytest.raises(ScheduleError, match="paused must be true or false"):
        orc.schedules.apply(path)


def test_a_leap_day_schedule_is_accepted_and_fires_on_29_february(orc: Orchestrator, spec: Path) -> None:
    added = orc.schedules.add("leap", cron="0 0 29 2 *", spec=str(spec))
    assert (added.next_at.month, added.next_at.day) == (2, 29) and added.next_at > orc.store.schedule_rows.now()
    with pytest.raises(ScheduleError, match="never fires"):
        orc.schedules.add("never", cron="0 0 30 2 *", spec=str(spec))


def test_trigger_reads_the_database_clock_once(orc: Orchestrator, spec: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    orc.schedules.add("manual", every=3600, spec=str(spec))
    rows = orc.store.schedule_rows
    readings: list[dt.datetime] = []
    real = rows.now

    def now() -> dt.datetime:
        readings.append(real())
        return readings[-1]

    monkeypatch.setattr(rows, "now", now)
    fired = orc.schedules.trigger("manual")
    assert len(readings) == 1
    assert fired.logical_date == readings[0].replace(microsecond=readings[0].microsecond // 1000 * 1000)


# ---------------------------------------------------------------------------- issue 18: factories, names, interval

#: callables that must never be a schedule's factory (the probe: all four were accepted, rmtree ran)
HOSTILE = ["builtins:eval", "builtins:exec", "shutil:rmtree", "os:makedirs"]


def schedule_rows(orc: Orchestrator) -> list[Any]:
    with orc.store.engine.connect() as conn:
        return list(conn.execute(sa.select(s.schedules.c.tenant, s.schedules.c.name)).all())


@pytest.mark.parametrize("path", [*HOSTILE, "tests.factories:undeclared", "subprocess:run", "os.path:join"])
def test_only_declared_factories_are_accepted(orc: Orchestrator, path: str, tmp_path: Path) -> None:
    with pytest.raises(FactoryNotAllowed, match="DAG factory"):
        orc.schedules.add("evil", every=60, dag=path)
    listing = tmp_path / "s.yaml"
    listing.write_text(f"schedules:\n  - {{name: evil, every: 60, dag: '{path}'}}\n")
    with pytest.raises(FactoryNotAllowed):
        orc.schedules.apply(listing)
    assert schedule_rows(orc) == []


def test_a_module_outside_the_setting_is_not_even_imported(orc: Orchestrator) -> None:
    import sys

    assert "antigravity" not in sys.modules
    with pytest.raises(FactoryNotAllowed, match="ORCHESTRATOR_DAG_FACTORY_MODULES"):
        orc.schedules.add("x", every=60, dag="antigravity:fly")
    assert "antigravity" not in sys.modules
    # the deployment's default lists tasks.dags alone: the tests' factories are refused there
    plain = bound(orc, "acme", dag_factory_modules=("tasks.dags",))
    try:
        with pytest.raises(FactoryNotAllowed):
            plain.schedules.add("x", every=60, dag="tests.factories:probe")
        assert plain.schedules.add("etl", every=300, dag="tasks.dags:daily_etl").factory == "tasks.dags:daily_etl"
    finally:
        plain.store.dispose()


@pytest.mark.parametrize("path", [*HOSTILE, "tests.factories:undeclared"])
def test_beat_never_calls_a_planted_factory(orc: Orchestrator, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A schedule row naming a callable that is not a declared factory (written by SQL, or a
    factory no longer declared): the firing fails with a named error and nothing is called."""
    import builtins
    import os
    import shutil

    import tests.factories

    called: list[str] = []

    def sentinel(name: str, real: Any) -> Any:
        """``real``, but a call as a factory (a date first) is recorded and goes no further."""

        def fn(*args: Any, **kwargs: Any) -> Any:
            if args and isinstance(args[0], dt.datetime):
                called.append(name)
                raise AssertionError(f"{name} was called as a factory")
            return real(*args, **kwargs)

        return fn

    for module, attr in ((builtins, "eval"), (builtins, "exec"), (shutil, "rmtree"), (os, "makedirs")):
        monkeypatch.setattr(module, attr, sentinel(f"{module.__name__}:{attr}", getattr(module, attr)))
    monkeypatch.setattr(tests.factories, "undeclared", sentinel("tests.factories:undeclared", None))
    orc.schedules.add("planted", every=60, dag="tests.factories:probe")
    with orc.store.engine.begin() as conn:
        conn.execute(s.schedules.update().where(s.schedules.c.name == "planted").values(factory=path))
    rewind(orc, "planted", 61)
    orc.schedules.tick()
    orc.schedules.trigger("planted")
    assert called == []
    assert runs_of(orc, "planted") == []
    found = firings(orc, "planted")
    assert found and all(f.state == "failed" and "FactoryNotAllowed" in f.reason for f in found)
    assert "FactoryNotAllowed" in (orc.schedules.get("planted").last_error or "")


def test_schedule_names_are_per_tenant(orc: Orchestrator, spec: Path) -> None:
    """Two tenants each have a schedule called nightly; each fires its own runs; neither sees,
    changes or is told about the other's."""
    alpha, bravo = bound(orc, "alpha"), bound(orc, "bravo")
    try:
        alpha.schedules.add("nightly", every=60, dag=f"{HERE}:by_params")
        bravo.schedules.add("nightly", every=120, spec=str(spec))
        assert sorted(schedule_rows(orc)) == [("alpha", "nightly"), ("bravo", "nightly")]
        assert alpha.schedules.get("nightly").timing.every == 60 and bravo.schedules.get("nightly").timing.every == 120
        with orc.store.engine.begin() as conn:  # both due
            now = orc.store.schedule_rows.now()
            conn.execute(
                s.schedules.update().values(
                    last_at=now - dt.timedelta(seconds=150), next_at=now - dt.timedelta(seconds=1)
                )
            )
        orc.schedules.tick()  # beat: an unbound orchestrator fires both
        rows = run_rows(orc, "nightly")
        assert sorted(r.tenant for r in rows) == ["alpha", "bravo"]
        assert {r.tenant: r.dag_name for r in rows} == {"alpha": "by-params", "bravo": "report"}
        for o in (alpha, bravo):
            assert [f.state for f in o.schedules.firings("nightly")].count("fired") == 1
        assert alpha.schedules.get("nightly").last_run_id == next(r.id for r in rows if r.tenant == "alpha")
        # a manual trigger of the same instant twice by both tenants: one run each
        fa, fb = alpha.schedules.trigger("nightly"), bravo.schedules.trigger("nightly")
        assert fa.created and fb.created and fa.run_id != fb.run_id
        # pause, remove: one tenant's only
        alpha.schedules.pause("nightly")
        assert not bravo.schedules.get("nightly").paused
        alpha.schedules.remove("nightly")
        assert bravo.schedules.get("nightly").tenant == "bravo"
        assert [f.state for f in bravo.schedules.firings("nightly")].count("fired") == 2
    finally:
        alpha.store.dispose()
        bravo.store.dispose()


def test_no_error_names_another_tenant(orc: Orchestrator, spec: Path) -> None:
    alpha, bravo = bound(orc, "alpha"), bound(orc, "bravo")
    try:
        bravo.schedules.add("bravo-only", every=60, spec=str(spec))
        messages = []
        for call in (
            lambda: alpha.schedules.get("bravo-only"),
            lambda: alpha.schedules.pause("bravo-only"),
            lambda: alpha.schedules.trigger("bravo-only"),
            lambda: alpha.schedules.remove("bravo-only"),
            lambda: alpha.schedules.firings("bravo-only"),
            lambda: list(alpha.schedules.backfill("bravo-only", dt.datetime(2026, 1, 1), dt.datetime(2026, 1, 2))),
        ):
            with pytest.raises(Exception) as caught:  # any refusal: its text is what is checked
                call()
            messages.append(str(caught.value))
        dag = DAG("planted")
        dag.task("a", "tasks.probes.noop")
        with pytest.raises(ValidationError) as caught:
            alpha.submit(dag, schedule="bravo-only", logical_date="2026-01-01T00:00:00+00:00")
        messages.append(str(caught.value))
        # taking the name is allowed, and says nothing about bravo's
        assert alpha.schedules.add("bravo-only", every=60, spec=str(spec)).tenant == "alpha"
        assert all("bravo" not in m.replace("bravo-only", "") for m in messages), messages
        assert bravo.schedules.get("bravo-only").tenant == "bravo"
    finally:
        alpha.store.dispose()
        bravo.store.dispose()


def test_an_operator_asked_for_an_ambiguous_name_is_told_to_choose(orc: Orchestrator, spec: Path) -> None:
    for tenant in ("alpha", "bravo"):
        o = bound(orc, tenant)
        try:
            o.schedules.add("nightly", every=60, spec=str(spec))
        finally:
            o.store.dispose()
    with pytest.raises(ScheduleError, match="act as one of them"):
        orc.schedules.get("nightly")
    assert sorted(x.tenant for x in orc.schedules.all()) == ["alpha", "bravo"]


@pytest.mark.parametrize(
    ("kwargs", "ok"),
    [
        ({"every": 1}, False),
        ({"every": 59.9}, False),
        ({"every": 60}, True),
        ({"cron": "* * * * *"}, True),
        ({"cron": "*/5 * * * *", "least": 600}, False),
        ({"cron": "0,1 3 * * *", "least": 120}, False),  # two minutes apart once a day
        ({"cron": "0 * * * *", "least": 3600}, True),
        ({"cron": "59 23 * * *", "least": 86400}, True),
    ],
)
def test_a_minimum_interval_is_enforced(orc: Orchestrator, spec: Path, kwargs: dict[str, Any], ok: bool) -> None:
    least = kwargs.pop("least", 60)
    strict = bound(orc, "default", schedule_min_interval_seconds=least)
    try:
        if ok:
            strict.schedules.add("timed", spec=str(spec), **kwargs)
        else:
            with pytest.raises(ScheduleError, match="ORCHESTRATOR_SCHEDULE_MIN_INTERVAL_SECONDS"):
                strict.schedules.add("timed", spec=str(spec), **kwargs)
            path = spec.parent / "timed.yaml"
            entry = ", ".join(f"{k}: {v!r}" for k, v in kwargs.items())
            path.write_text(f"schedules:\n  - {{name: timed, {entry}, spec: {spec.name}}}\n")
            with pytest.raises(ScheduleError, match="minimum interval"):
                strict.schedules.apply(path)
            assert schedule_rows(orc) == []
    finally:
        strict.store.dispose()


def test_the_default_minimum_interval_is_a_minute() -> None:
    from orchestrator import Settings

    assert Settings().schedule_min_interval_seconds == 60.0
    assert Settings.from_env({"ORCHESTRATOR_SCHEDULE_MIN_INTERVAL_SECONDS": "300"}).schedule_min_interval_seconds == 300
    assert Settings().dag_factory_modules == ("tasks.dags",)
