"""The DAG registry (issue 24): register a DAG once (a new version only when its content changes,
one version from concurrent registrations), run it by name and version, diff two versions,
pause it (schedules skip, a submit by hand runs and says so), per-tenant names, a schedule on a
registered DAG that follows the latest version from its next instant on. The CLI's commands
on the same database (``orchestrator dag ...``, ``submit --dag``, ``runs --version``)."""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orchestrator import DAG, DagNotFound, DagVersionNotFound, Orchestrator, ValidationError
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.core.errors import UnknownTaskError
from orchestrator.services.dag_registry import content_hash, definition, parse_ref
from orchestrator.store import schema as s
from tests.store.dynamic import drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean, schedule_min_interval_seconds=0)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def bound(orc: Orchestrator, tenant: str) -> Orchestrator:
    return Orchestrator(orc.settings, store=orc.store, publisher=orc.publisher, registry=orc.registry, tenant=tenant)


def etl(*, retries: int = 1, extra: bool = False, reverse: bool = False, day: str = "{{ ds }}") -> DAG:
    dag = DAG("etl", params={"region": "eu"})
    nodes = [("extract", (), {"day": day}), ("load", ("extract",), {})]
    if extra:
        nodes.append(("report", ("load",), {}))
    for key, upstream, kwargs in reversed(nodes) if reverse else nodes:
        dag.task(key, "t", upstream=list(upstream), kwargs=kwargs, max_attempts=retries)
    return dag


def version_rows(orc: Orchestrator) -> list[Any]:
    with orc.store.engine.connect() as conn:
        return list(conn.execute(sa.select(s.dag_versions).order_by(s.dag_versions.c.version)).all())


# ---------------------------------------------------------------- registering


def test_the_same_content_is_one_version_whatever_order_it_was_built_in(orc: Orchestrator) -> None:
    first = orc.register(etl(), by="alice")
    assert (first.name, first.version, first.created, first.tenant) == ("etl", 1, True, "default")
    again = orc.register(etl(reverse=True), by="bob")
    assert (again.version, again.created, again.content_hash) == (1, False, first.content_hash)
    assert len(version_rows(orc)) == 1 and version_rows(orc)[0].registered_by == "alice"
    assert first.spec is not None and "tenant" not in first.spec and first.dag().name == "etl"


def test_changed_content_bumps_the_version_and_going_back_is_a_new_one(orc: Orchestrator) -> None:
    assert orc.register(etl()).version == 1
    assert orc.register(etl(retries=3)).version == 2
    back = orc.register(etl())
    assert (back.version, back.created) == (3, True)  # differs from the latest (v2): a new version
    assert orc.register(etl()).version == 3
    assert [v.version for v in orc.dags.versions("etl")] == [1, 2, 3]
    assert orc.dags.get("etl").latest_version == 3
    assert orc.dags.version("etl", 1).content_hash == orc.dags.version("etl", 3).content_hash


def _register_many(url: str, start: Any, out: Any) -> None:
    o = orchestrator(url)
    try:
        start.wait(30)
        out.put(sorted({o.register(etl(extra=True)).version for _ in range(20)}))
    finally:
        o.store.dispose()


def test_concurrent_registrations_of_one_content_from_two_processes_make_one_version(
    orc: Orchestrator, pg_clean: str
) -> None:
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_register_many, args=(pg_clean, start, out)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        start.set()
        seen = [out.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert seen == [[1], [1]]
    assert [r.version for r in version_rows(orc)] == [1]
    assert all(p.exitcode == 0 for p in procs)


def test_a_dag_that_would_not_submit_is_refused_and_nothing_is_stored(orc: Orchestrator) -> None:
    bad = DAG("etl")
    bad.task("a", "not.registered.task")
    with pytest.raises(UnknownTaskError):
        orc.register(bad)
    with pytest.raises(ValidationError):
        orc.register("etl")  # type: ignore[arg-type]
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(s.dags)).scalar_one() == 0
    assert version_rows(orc) == []


def test_names_and_versions_are_per_tenant(orc: Orchestrator) -> None:
    acme, other = bound(orc, "acme"), bound(orc, "other")
    assert acme.register(etl()).tenant == "acme"
    with pytest.raises(DagNotFound, match="no registered DAG named 'etl' for tenant 'other'"):
        other.dags.get("etl")
    with pytest.raises(DagNotFound):
        other.submit_registered("etl")
    assert other.register(etl(retries=2)).version == 1  # its own etl, its own history
    assert [d.tenant for d in orc.dags.list()] == ["acme", "other"]
    assert [d.tenant for d in acme.dags.list()] == ["acme"]
    with pytest.raises(ValidationError):
        acme.dags.get("etl", tenant="other")


# ---------------------------------------------------------------- running by name


def test_submit_registered_runs_the_latest_or_the_given_version(orc: Orchestrator) -> None:
    orc.register(etl())
    orc.register(etl(extra=True))
    latest = orc.submit_registered("etl", params={"region": "us"})
    view = latest.status()
    assert view.dag_version == 2 and view.task_count == 3 and view.params == {"region": "us"}
    assert view.to_json()["dag_version"] == 2
    pinned = orc.submit_registered("etl", 1)
    assert pinned.status().dag_version == 1 and pinned.status().task_count == 2
    assert [r.id for r in orc.runs(dag="etl", dag_version=1)] == [pinned.id]
    assert {r.id for r in orc.runs(dag="etl")} == {latest.id, pinned.id}
    with pytest.raises(DagVersionNotFound, match="no version 7"):
        orc.submit_registered("etl", 7)
    with pytest.raises(DagNotFound):
        orc.submit_registered("nope")
    with pytest.raises(ValidationError):
        orc.submit_registered("etl", 0)
    with pytest.raises(ValidationError):
        orc.runs(dag_version=1)  # a version filter needs the DAG
    rerun = orc.rerun(pinned.id)
    assert rerun.status().dag_version == 1 and rerun.status().rerun_of == pinned.id
    plain = orc.submit(etl())
    assert plain.status().dag_version is None  # a DAG submitted as an object is not a version


def test_a_registered_run_runs_to_success(orc: Orchestrator) -> None:
    orc.register(etl(day="2026-11-25"))
    handle = orc.submit_registered("etl")
    d = drive(orc, etl(), run_id=handle.id)
    assert d.run_state() == "SUCCEEDED"


def test_diff_names_nodes_edges_and_fields(orc: Orchestrator) -> None:
    orc.register(etl())
    changed = etl(retries=3, extra=True)
    changed.params = {"region": "us"}
    orc.register(changed)
    found = orc.dags.diff("etl", 1, 2)
    assert found.nodes_added == ["report"] and found.nodes_removed == []
    assert found.edges_added == [("load", "report")] and found.edges_removed == []
    assert set(found.nodes_changed) == {"extract", "load"}
    assert found.nodes_changed["extract"]["max_attempts"] == (1, 3)
    assert found.fields == {"params": ({"region": "eu"}, {"region": "us"})}
    back = orc.dags.diff("etl", 2, 1)
    assert back.nodes_removed == ["report"] and back.edges_removed == [("load", "report")]
    assert orc.dags.diff("etl", 1, 1).empty and orc.dags.diff("etl", 1, 1).lines()[-1] == "no differences"
    assert json.loads(json.dumps(found.to_json()))["nodes"]["added"] == ["report"]


def test_pause_stops_schedules_but_not_a_submit_by_hand(orc: Orchestrator) -> None:
    orc.register(etl())
    paused = orc.dags.pause("etl", by="alice")
    assert paused.paused and paused.paused_by == "alice"
    run = orc.submit_registered("etl")
    assert any("is paused" in w and "this submit by hand does" in w for w in run.warnings)
    assert orc.dags.unpause("etl").paused is False
    assert not any("paused" in w for w in orc.submit_registered("etl").warnings)
    with pytest.raises(DagNotFound):
        orc.dags.pause("nope")


def test_refs_and_versions_are_checked() -> None:
    assert parse_ref("etl") == ("etl", None) and parse_ref("etl@3") == ("etl", 3)
    assert parse_ref("a@b@2") == ("a@b", 2)
    for bad in ("etl@", "etl@0", "etl@x", "etl@-1", ""):
        with pytest.raises(ValidationError):
            parse_ref(bad)
    spec = definition(etl())
    assert content_hash(spec) == content_hash(definition(etl(reverse=True)))


# ---------------------------------------------------------------- schedules on registered DAGs


def rewind(orc: Orchestrator, name: str, seconds: float) -> None:
    now = orc.store.schedule_rows.now()
    with orc.store.engine.begin() as conn:
        conn.execute(
            s.schedules.update()
            .where(s.schedules.c.name == name)
            .values(last_at=now - dt.timedelta(seconds=seconds), next_at=now - dt.timedelta(seconds=seconds - 1))
        )


def fired(orc: Orchestrator, name: str) -> list[Any]:
    return sorted(orc.store.schedule_rows.firings(name, 100), key=lambda f: f.logical_date)


def next_tick(orc: Orchestrator, name: str) -> None:
    """Wait until the schedule's next instant has passed on the database clock, then a pass."""
    import time

    due = orc.schedules.get(name).next_at
    while orc.store.schedule_rows.now() < due:
        time.sleep(0.05)
    orc.schedules.tick()


def test_a_schedule_follows_the_latest_version_from_its_next_instant_on(orc: Orchestrator) -> None:
    orc.register(etl())
    added = orc.schedules.add("nightly", every=1, registered="etl")
    assert added.registered == "etl" and added.registered_version is None and "registered etl" in added.what
    next_tick(orc, "nightly")
    orc.register(etl(extra=True))  # re-registered mid-way
    next_tick(orc, "nightly")
    done = [f for f in fired(orc, "nightly") if f.state == "fired"]
    assert [f.dag_version for f in done] == [1, 2]
    versions = [orc.visible(f.run_id).dag_version for f in done]
    assert versions == [1, 2]
    second = orc.run(done[1].run_id)
    assert second.status().task_count == 3
    # the spec's placeholders are rendered at each instant, the schedule's params laid over
    assert second.task("extract").kwargs["day"] == done[1].logical_date.date().isoformat()


def test_a_pinned_schedule_keeps_its_version(orc: Orchestrator) -> None:
    orc.register(etl())
    orc.register(etl(extra=True))
    orc.schedules.add("pinned", every=60, registered="etl@1", params={"region": "ap"})
    trig = orc.schedules.trigger("pinned")
    view = orc.visible(str(trig.run_id))
    assert view.dag_version == 1 and view.params == {"region": "ap"}
    assert orc.schedules.get("pinned").to_json()["registered_version"] == 1


def test_a_paused_dags_schedule_records_a_skipped_firing_and_a_trigger_still_runs(orc: Orchestrator) -> None:
    orc.register(etl())
    orc.schedules.add("nightly", every=1, registered="etl")
    orc.dags.pause("etl")
    next_tick(orc, "nightly")
    (skipped,) = [f for f in fired(orc, "nightly") if f.state != "fired"]
    assert skipped.state == "skipped" and skipped.reason.startswith("dag_paused") and skipped.run_id is None
    assert skipped.dag_version == 1
    assert orc.runs(dag="etl") == []
    manual = orc.schedules.trigger("nightly")  # by hand: runs
    assert manual.run_id is not None and orc.visible(manual.run_id).dag_version == 1
    orc.dags.unpause("etl")
    next_tick(orc, "nightly")
    assert [f.kind for f in fired(orc, "nightly") if f.state == "fired"] == ["manual", "scheduled"]


def test_a_schedule_of_a_missing_dag_or_version_is_refused(orc: Orchestrator) -> None:
    with pytest.raises(DagNotFound):
        orc.schedules.add("x", every=60, registered="nope")
    orc.register(etl())
    with pytest.raises(DagVersionNotFound):
        orc.schedules.add("x", every=60, registered="etl@4")
    with pytest.raises(Exception, match="one of them"):
        orc.schedules.add("x", every=60, registered="etl", spec=etl())
    assert orc.schedules.all() == []


def test_a_schedule_file_names_a_registered_dag(orc: Orchestrator, tmp_path: Path) -> None:
    orc.register(etl())
    path = tmp_path / "schedules.yaml"
    path.write_text("schedules:\n  - {name: nightly, every: 60, registered: etl@1}\n")
    (found,) = orc.schedules.apply(path)
    assert found.registered == "etl" and found.registered_version == 1


# ---------------------------------------------------------------- the CLI


@pytest.fixture
def use_cli(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    return CliRunner()


SPEC = """name: etl
params: {region: eu}
nodes:
  - {key: extract, task: t, kwargs: {day: "2026-11-25"}}
  - {key: load, task: t, upstream: [extract]}
"""


def test_cli_register_versions_show_diff_submit_and_pause(use_cli: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "etl.yaml"
    spec.write_text(SPEC)
    first = use_cli.invoke(cli.main, ["dag", "register", str(spec)])
    assert first.exit_code == 0 and first.stdout.strip() == "etl v1", first.output
    again = use_cli.invoke(cli.main, ["dag", "register", str(spec)])
    assert again.exit_code == 0 and again.stdout.strip() == "etl v1" and "unchanged" in again.stderr
    spec.write_text(SPEC + "  - {key: report, task: t, upstream: [load]}\n")
    assert use_cli.invoke(cli.main, ["dag", "register", str(spec)]).stdout.strip() == "etl v2"

    listed = use_cli.invoke(cli.main, ["dag", "versions", "etl"])
    assert listed.exit_code == 0 and "latest v2" in listed.stdout
    assert [line.split()[0] for line in listed.stdout.splitlines()[1:]] == ["v1", "v2"]
    shown = use_cli.invoke(cli.main, ["dag", "show", "etl", "--version", "1", "--json"])
    assert json.loads(shown.stdout)["version"] == 1 and len(json.loads(shown.stdout)["spec"]["nodes"]) == 2
    text = use_cli.invoke(cli.main, ["dag", "show", "etl"]).stdout
    assert "etl v2 of 2" in text and "report  t  after load" in text
    diffed = use_cli.invoke(cli.main, ["dag", "diff", "etl", "1", "2"])
    assert diffed.stdout.splitlines() == ["etl v1 -> v2", "+ node report", "+ edge load -> report"]

    ran = use_cli.invoke(cli.main, ["submit", "--dag", "etl@1", "--param", "region=us", "--param", "n=3"])
    assert ran.exit_code == 0, ran.output
    run_id = ran.stdout.strip()
    status = json.loads(use_cli.invoke(cli.main, ["status", run_id, "--json"]).stdout)
    assert status["run"]["dag_version"] == 1 and status["run"]["params"] == {"region": "us", "n": 3}
    assert "version 1" in use_cli.invoke(cli.main, ["status", run_id]).stdout
    latest = use_cli.invoke(cli.main, ["submit", "--dag", "etl"]).stdout.strip()
    runs = use_cli.invoke(cli.main, ["runs", "--dag", "etl", "--version", "1"]).stdout
    assert run_id in runs and latest not in runs and "etl@1" in runs

    assert "paused" in use_cli.invoke(cli.main, ["dag", "pause", "etl"]).stdout
    by_hand = use_cli.invoke(cli.main, ["submit", "--dag", "etl"])
    assert by_hand.exit_code == 0 and "warning: DAG 'etl' is paused" in by_hand.stderr
    assert "etl  v2  paused" in use_cli.invoke(cli.main, ["dag", "list"]).stdout
    assert "unpaused" in use_cli.invoke(cli.main, ["dag", "unpause", "etl"]).stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dag", "show", "nope"], "no registered DAG named 'nope'"),
        (["dag", "show", "etl", "--version", "9"], "has no version 9"),
        (["dag", "diff", "etl", "1", "5"], "has no version 5"),
        (["submit", "--dag", "etl@x"], "a DAG version is a number"),
        (["submit", "--dag", "etl@4"], "has no version 4"),
        (["dag", "pause", "nope"], "no registered DAG named 'nope'"),
    ],
)
def test_cli_refusals_exit_2_naming_the_problem(
    use_cli: CliRunner, tmp_path: Path, args: list[str], message: str
) -> None:
    spec = tmp_path / "etl.yaml"
    spec.write_text(SPEC)
    assert use_cli.invoke(cli.main, ["dag", "register", str(spec)]).exit_code == 0
    done = use_cli.invoke(cli.main, args)
    assert done.exit_code == 2 and "error: " in done.stderr and message in done.stderr, done.output


def test_cli_register_of_a_bad_spec_stores_nothing(use_cli: CliRunner, orc: Orchestrator, tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: etl\nnodes:\n  - {key: a, task: not.a.task}\n")
    done = use_cli.invoke(cli.main, ["dag", "register", str(spec)])
    assert done.exit_code == 2 and "not.a.task" in done.stderr
    assert version_rows(orc) == []
    usage = use_cli.invoke(cli.main, ["submit"])
    assert usage.exit_code == 2 and "give a spec FILE or --dag" in usage.output
    usage = use_cli.invoke(cli.main, ["runs", "--version", "1"])
    assert usage.exit_code == 2 and "--version goes with --dag" in usage.output
