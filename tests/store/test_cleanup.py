"""Pruning finished runs (``orchestrator db clean``, issue 21): only final runs created and
finished before the cut-off go, with their tasks, edges and ledger; RUNNING runs and newer ones
stay; batches; an archive holds everything removed; a run reopened by a clear is never half
removed."""

from __future__ import annotations

import datetime as dt
import io
import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator
from orchestrator import schema as s
from tests.store.dynamic import Fail, drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def chain(name: str = "c") -> DAG:
    dag = DAG(name)
    dag.task("a", "t")
    dag.task("b", "t", upstream=["a"])
    return dag


def counts(orc: Orchestrator) -> dict[str, int]:
    with orc.store.engine.connect() as conn:
        return {
            t.name: conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
            for t in (s.runs, s.tasks, s.edges, s.events)
        }


def age(orc: Orchestrator, run_id: str, days: float) -> None:
    """As if the run had been created and finished ``days`` ago."""
    back = dt.timedelta(days=days)
    with orc.store.engine.begin() as conn:
        conn.execute(
            s.runs.update()
            .where(s.runs.c.id == run_id)
            .values(created_at=s.runs.c.created_at - back, finished_at=s.runs.c.finished_at - back)
        )


def test_only_final_runs_before_the_cut_off_are_removed_with_everything_of_theirs(orc: Orchestrator) -> None:
    old_ok = drive(orc, chain()).run_id
    old_failed = drive(orc, chain(), lambda key, kw, up: (_ for _ in ()).throw(Fail("x"))).run_id
    running = orc.submit(chain()).id
    recent = drive(orc, chain()).run_id
    for run_id in (old_ok, old_failed, running):
        age(orc, run_id, 40)
    before = counts(orc)
    cut = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    preview = orc.store.cleanup.count(cut)
    assert preview.runs == 2 and preview.by_state == {"SUCCEEDED": 1, "FAILED": 1}
    assert counts(orc) == before  # a preview writes nothing
    out = io.StringIO()
    done = orc.store.cleanup.clean(cut, batch=1, archive=out)
    assert (done.runs, done.batches, done.tasks, done.edges) == (2, 2, 4, 2)
    assert done.events == preview.events > 0
    after = counts(orc)
    assert after["orc_runs"] == 2 and after["orc_task_events"] == before["orc_task_events"] - done.events
    assert {r.id for r in orc.runs(limit=10)} == {running, recent}
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {d["run"]["id"] for d in docs} == {old_ok, old_failed}
    assert all(len(d["tasks"]) == 2 and d["edges"] == [["a", "b"]] and d["events"] for d in docs)
    assert orc.store.cleanup.clean(cut).runs == 0  # nothing left to do


def test_a_tenants_clean_leaves_the_others(orc: Orchestrator) -> None:
    mine = drive(orc, chain().with_tenant("acme")).run_id
    theirs = drive(orc, chain()).run_id
    for run_id in (mine, theirs):
        age(orc, run_id, 10)
    cut = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    assert orc.store.cleanup.clean(cut, tenant="acme").runs == 1
    assert [r.id for r in orc.runs(limit=10)] == [theirs]


def test_a_run_reopened_by_a_clear_is_not_removed(orc: Orchestrator) -> None:
    run_id = drive(orc, chain()).run_id
    age(orc, run_id, 10)
    orc.clear(run_id, "b", by="ops")  # reopened: RUNNING again
    cut = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    assert orc.store.cleanup.clean(cut).runs == 0
    assert orc.run_state(run_id).value == "RUNNING"


def test_the_db_clean_command(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    from pathlib import Path

    from click.testing import CliRunner

    from orchestrator import cli

    monkeypatch.setattr(cli, "_ready_store", lambda: orc)
    runner = CliRunner()
    old = drive(orc, chain()).run_id
    age(orc, old, 40)
    keep = drive(orc, chain()).run_id
    dry = runner.invoke(cli.main, ["db", "clean", "--before", "30d", "--dry-run"])
    assert dry.exit_code == 0 and dry.stdout.startswith("would remove 1 run(s) (1 succeeded)"), dry.output
    archive = Path(str(tmp_path)) / "old.jsonl"
    done = runner.invoke(cli.main, ["db", "clean", "--before", "30d", "--archive", str(archive), "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["runs"] == 1 and report["tasks"] == 2 and report["batches"] == 1
    assert json.loads(archive.read_text().splitlines()[0])["run"]["id"] == old
    assert [r.id for r in orc.runs(limit=5)] == [keep]
    bad = runner.invoke(cli.main, ["db", "clean", "--before", "last tuesday"])
    assert bad.exit_code == 2 and "ISO 8601" in bad.output


def test_a_pause_between_batches(orc: Orchestrator) -> None:
    """``pause`` seconds between two batches (none before the first or after the last)."""
    import time

    ids = [drive(orc, chain()).run_id for _ in range(3)]
    for run_id in ids:
        age(orc, run_id, 10)
    cut = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    seen: list[float] = []
    t0 = time.monotonic()
    done = orc.store.cleanup.clean(cut, batch=1, pause=0.2, progress=lambda _: seen.append(time.monotonic() - t0))
    assert (done.runs, done.batches) == (3, 3) and orc.runs(limit=10) == []
    assert len(seen) == 3 and seen[1] - seen[0] >= 0.2 and seen[2] - seen[1] >= 0.2
