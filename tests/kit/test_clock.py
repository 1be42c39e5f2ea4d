"""The virtual clock of the kit's database: what the database calls now moves for every way the
orchestrator asks for it (SQL, the server functions' cached plans, prepared statements,
``dbtime``), each test starts at real time, and a day of virtual time
passes in a fraction of a second of real time."""

from __future__ import annotations

import datetime as dt
import time

import pytest
import sqlalchemy as sa

from orchestrator import DAG, TaskState
from orchestrator.store.dbtime import db_now
from orchestrator.testing import Kit, KitDatabase, run_dag

pytestmark = pytest.mark.postgres

DAY = dt.timedelta(hours=24)


def real_now(db: KitDatabase) -> dt.datetime:
    with db.engine.connect() as conn:
        value: dt.datetime = conn.execute(sa.text("SELECT pg_catalog.now()")).scalar_one()
    return value


def test_advance_moves_every_now_of_the_database(orchestrator_db: KitDatabase) -> None:
    clock = orchestrator_db.clock
    start = clock.now()
    assert abs(start - real_now(orchestrator_db)) < dt.timedelta(seconds=5)
    with orchestrator_db.engine.connect() as conn:
        # one session throughout: its cached plans and prepared statements must follow the clock
        conn.exec_driver_sql(
            "CREATE OR REPLACE FUNCTION kit_now() RETURNS timestamptz LANGUAGE plpgsql"
            " SET plan_cache_mode = force_generic_plan AS $$ DECLARE v timestamptz;"
            " BEGIN SELECT now() INTO v; RETURN v; END $$"
        )
        conn.commit()
        before = [conn.execute(sa.text(q)).scalar_one() for q in ("SELECT kit_now()", "SELECT clock_timestamp()")]
        before.append(conn.execute(sa.select(db_now())).scalar_one())
        conn.commit()
        clock.advance(hours=24)
        after = [conn.execute(sa.text(q)).scalar_one() for q in ("SELECT kit_now()", "SELECT clock_timestamp()")]
        after.append(conn.execute(sa.select(db_now())).scalar_one())
        conn.commit()
        for b, a in zip(before, after, strict=True):
            assert DAY <= a - b < DAY + dt.timedelta(seconds=5), (b, a)
    assert clock.shift >= DAY


def test_each_test_starts_at_real_time(orchestrator_db: KitDatabase) -> None:
    """Runs after the test above moved the clock a day on: the clean state put it back."""
    assert orchestrator_db.clock.shift == dt.timedelta(0)
    assert abs(orchestrator_db.clock.now() - real_now(orchestrator_db)) < dt.timedelta(seconds=5)


def test_set_and_advance_to(orchestrator_db: KitDatabase) -> None:
    clock = orchestrator_db.clock
    new_year = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    assert new_year <= clock.set(new_year) < new_year + dt.timedelta(seconds=5)
    later = clock.advance_to(new_year + dt.timedelta(days=3))
    assert later >= new_year + dt.timedelta(days=3)
    assert clock.advance_to(new_year) >= later  # never back
    with pytest.raises(ValueError, match="forward"):
        clock.advance(seconds=-1)


def test_a_day_of_sleep_passes_in_a_moment_of_real_time(orchestrator: Kit) -> None:
    dag = DAG("nap")
    first = dag.task("first", "kit.value", kwargs={"x": 1})
    nap = dag.wait("nap", delay=24 * 3600, upstream=[first])
    dag.task("after", "kit.value", kwargs={"x": 2}, upstream=[nap])
    began = time.monotonic()
    result = run_dag(dag)
    took = time.monotonic() - began
    print(f"\n24 h sleep: {took * 1000:.0f} ms of real time, {result.elapsed} of virtual time")
    assert result.state == "SUCCEEDED", result.explain()
    assert result.elapsed >= DAY
    assert took < DAY.total_seconds() / 1000  # a day passed in far less than 86 s of real time
    woke = next(e for e in result.ledger if e.key == "nap" and e.to_state == TaskState.SUCCEEDED)
    began_waiting = next(e for e in result.ledger if e.key == "nap" and e.to_state == TaskState.WAITING)
    assert woke.at is not None and began_waiting.at is not None
    assert DAY <= woke.at - began_waiting.at < DAY + dt.timedelta(seconds=5)
    assert woke.actor == "reconciler"  # the reconciler's due-waits pass woke it, as in production


def test_without_auto_advance_the_test_moves_the_clock(orchestrator: Kit) -> None:
    dag = DAG("nap")
    dag.wait("nap", delay=3600)
    dag.task("after", "kit.value", upstream=["nap"])
    waiting = orchestrator.run_dag(dag, auto_advance=False)
    assert waiting.state == "RUNNING" and waiting.states["nap"] == TaskState.WAITING
    orchestrator.clock.advance(minutes=59)
    assert waiting.resume(auto_advance=False).states["nap"] == TaskState.WAITING
    orchestrator.clock.advance(minutes=2)
    done = waiting.resume(auto_advance=False)
    assert done.state == "SUCCEEDED" and done.results["after"] == 1


def test_a_run_started_at_a_given_instant(orchestrator: Kit) -> None:
    """``clock=datetime``: the run starts then, and a wall-time wait follows the clock."""
    dag = DAG("morning")
    dag.wait("opening", until="09:30", tz="Europe/Paris")
    dag.task("open", "kit.value", kwargs={"x": "open"}, upstream=["opening"])
    start = dt.datetime(2030, 1, 1, 6, 0, tzinfo=dt.UTC)  # 07:00 in Paris
    result = orchestrator.run_dag(dag, clock=start)
    assert result.state == "SUCCEEDED", result.explain()
    woke = next(e for e in result.ledger if e.key == "opening" and e.to_state == TaskState.SUCCEEDED)
    assert woke.at is not None
    assert dt.datetime(2030, 1, 1, 8, 30, tzinfo=dt.UTC) <= woke.at < dt.datetime(2030, 1, 1, 8, 31, tzinfo=dt.UTC)
    assert result.started_at >= start and result.elapsed > dt.timedelta(hours=2, minutes=29)
