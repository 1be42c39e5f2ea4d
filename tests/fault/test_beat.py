"""Schedules with real processes: `orchestrator beat` (celery beat with the database scheduler)
side by side, killed with -9 and restarted, one with its host clock an hour fast; pause, resume
and trigger from the CLI while beat runs; a factory that raises; a backfill killed part-way and
run again. Every assertion is read from the database."""

from __future__ import annotations

import datetime as dt
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator.store import schema as s
from orchestrator.store.schedules import iso
from tests.conftest import stop_embedded
from tests.fault.harness import Cluster, Proc
from tests.integration.conftest import stop_process

pytestmark = pytest.mark.fault
ROOT = Path(__file__).resolve().parents[2]


def beat(cluster: Cluster, name: str, *, fast_clock: bool = False) -> Proc:
    """``orchestrator beat`` in its own process group (under faketime +1h with ``fast_clock``)."""
    prefix = ["faketime", "-f", "+1h"] if fast_clock else []
    cmd = [*prefix, sys.executable, "-m", "orchestrator.cli", "beat", "--loglevel", "INFO"]
    return cluster._spawn(name, cmd, cluster.env(ORCHESTRATOR_BEAT_INTERVAL="0.5"))


def spec(tmp: Path, name: str = "beat-probe", task: str = "tasks.probes.noop") -> str:
    path = tmp / f"{name}.yaml"
    path.write_text(f"name: {name}\nnodes:\n  - {{key: only, task: {task}, kwargs: {{}}}}\n")
    return str(path)


def runs_of(cluster: Cluster, name: str) -> list[Any]:
    r = s.runs.c
    with cluster.store.engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(r.id, r.logical_date, r.created_at, r.finished_at, r.state)
                .where(r.schedule == name)
                .order_by(r.logical_date)
            ).all()
        )


def firings(cluster: Cluster, name: str) -> list[Any]:
    f = s.firings.c
    with cluster.store.engine.connect() as conn:
        return list(conn.execute(sa.select(s.firings).where(f.schedule == name).order_by(f.logical_date)).all())


def db_now(cluster: Cluster) -> dt.datetime:
    return cluster.store.schedule_rows.now()


def cli_ok(cluster: Cluster, *args: str) -> str:
    out = cluster.cli(*args)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout


def test_two_beats_fire_each_minute_once_and_a_fast_clock_never_fires_early(cluster: Cluster, tmp_path: Path) -> None:
    """Two beats side by side (one with its host clock an hour fast) on an every-minute cron for
    three minute instants: exactly one run per instant, none created before its instant."""
    cli_ok(cluster, "schedule", "add", "minutely", "--cron", "* * * * *", "--spec", spec(tmp_path))
    # the schedule's first instant, as the add fixed it (an add at hh:mm:59.9 makes it the next minute)
    first = cluster.orc.schedules.get("minutely").next_at
    instants = [first + dt.timedelta(minutes=i) for i in range(3)]
    beats = [beat(cluster, "beat-a"), beat(cluster, "beat-b", fast_clock=True)]
    cluster.wait_for(
        lambda: db_now(cluster) >= instants[-1] + dt.timedelta(seconds=5), 240, "three minute instants to pass"
    )
    for b in beats:
        assert b.popen.poll() is None, b.tail()
    got = [r for r in runs_of(cluster, "minutely") if dt.datetime.fromisoformat(r.logical_date) <= instants[-1]]
    assert [dt.datetime.fromisoformat(r.logical_date) for r in got] == instants
    for r in got:  # due-ness is judged by the database clock: the fast beat fired nothing early
        assert r.created_at >= dt.datetime.fromisoformat(r.logical_date)
    fired = [f for f in firings(cluster, "minutely") if f.state == "fired"]
    assert len({f.logical_date for f in fired}) == len(fired) >= 3
    lag = [(r.created_at - dt.datetime.fromisoformat(r.logical_date)).total_seconds() for r in got]
    print(
        f"two beats: {len(got)} runs for {len(instants)} instants;"
        f" instant -> run created {min(lag):.2f}-{max(lag):.2f}s"
    )
    # both beats took part (whichever held the schedule's row lock at each instant)
    assert "scheduler pass failed" not in beats[0].text() + beats[1].text()


def test_beat_killed_and_restarted_creates_no_duplicate_and_catches_up(cluster: Cluster, tmp_path: Path) -> None:
    """kill -9 while firing every 2 s; restarted after missing several instants: catch-up
    latest runs the most recent one and records the others as skipped; no instant twice. A
    firing left pending by a beat that died mid-firing is finished once by the next beat."""
    cli_ok(cluster, "schedule", "add", "fast", "--every", "2", "--spec", spec(tmp_path))
    b1 = beat(cluster, "beat-1")
    cluster.wait_for(lambda: len(runs_of(cluster, "fast")) >= 2, 30, "two firings")
    b1.signal_group(signal.SIGKILL)
    b1.popen.wait(10)
    before = len(runs_of(cluster, "fast"))
    killed_at = db_now(cluster)
    # a beat that died between deciding an instant and creating its run left it pending
    orphan = killed_at.replace(microsecond=0) - dt.timedelta(hours=1)
    with cluster.store.engine.begin() as conn:
        conn.execute(
            s.firings.insert().values(
                tenant="default",
                schedule="fast",
                logical_date=orphan,
                state="pending",
                kind="scheduled",
                at=killed_at - dt.timedelta(minutes=5),
            )
        )
    time.sleep(7)  # three or four instants missed
    beat(cluster, "beat-2")
    cluster.wait_for(lambda: len(runs_of(cluster, "fast")) >= before + 3, 60, "firing again after the restart")
    runs = runs_of(cluster, "fast")
    dates = [r.logical_date for r in runs]
    assert len(dates) == len(set(dates))
    assert iso(orphan) in dates  # the pending firing was finished, once
    missed = [
        f
        for f in firings(cluster, "fast")
        if f.state == "skipped" and f.logical_date > killed_at and "missed" in (f.reason or "")
    ]
    assert len(missed) >= 2, [(f.logical_date, f.state, f.reason) for f in firings(cluster, "fast")]


def test_pause_resume_trigger_from_the_cli_while_beat_runs(cluster: Cluster, tmp_path: Path) -> None:
    cli_ok(cluster, "schedule", "add", "ctl", "--every", "1", "--spec", spec(tmp_path))
    beat(cluster, "beat")
    cluster.worker("w1", concurrency=2)
    # a schedule added while beat runs fires without a restart; its task sees its logical date
    cli_ok(cluster, "schedule", "add", "late", "--every", "2", "--spec", spec(tmp_path, "late", "tasks.probes.whoami"))
    cluster.wait_for(
        lambda: any(r.state == "SUCCEEDED" for r in runs_of(cluster, "late")), 30, "the added schedule's first run"
    )
    done = next(r for r in runs_of(cluster, "late") if r.state == "SUCCEEDED")
    seen = cluster.orc.run(done.id).task("only").result
    assert seen["run_id"] == done.id and seen["logical_date"] == done.logical_date
    cluster.wait_for(lambda: len(runs_of(cluster, "ctl")) >= 1, 20, "the first firing")
    cli_ok(cluster, "schedule", "remove", "late")
    cli_ok(cluster, "schedule", "pause", "ctl")
    paused_at = db_now(cluster)
    time.sleep(3)  # a window for a wrong firing to show (every 1 s)
    # nothing fired while paused: no firing decided after the pause committed (one decided by a
    # pass under way when it came is older, however late a loaded machine commits it)
    late = [f for f in firings(cluster, "ctl") if f.kind == "scheduled" and f.state == "fired" and f.at > paused_at]
    assert late == [], [(f.logical_date, f.at, paused_at) for f in late]
    paused = len(runs_of(cluster, "ctl"))
    run_id = cli_ok(cluster, "schedule", "trigger", "ctl").strip()
    assert run_id in {r.id for r in runs_of(cluster, "ctl")}
    (listed,) = json.loads(cli_ok(cluster, "schedule", "list", "--json"))["schedules"]
    assert listed["paused"] is True and listed["next_fire"] is None
    cli_ok(cluster, "schedule", "resume", "ctl")
    cluster.wait_for(lambda: len(runs_of(cluster, "ctl")) >= paused + 3, 60, "firing again after resume")
    kinds = [f.kind for f in firings(cluster, "ctl") if f.state == "fired"]
    assert kinds.count("manual") == 1


def test_a_factory_that_raises_is_recorded_and_the_others_keep_firing(cluster: Cluster, tmp_path: Path) -> None:
    cli_ok(cluster, "schedule", "add", "broken", "--every", "1", "--dag", "tests.factories:broken")
    cli_ok(cluster, "schedule", "add", "healthy", "--every", "1", "--dag", "tests.factories:probe")
    b = beat(cluster, "beat")
    cluster.wait_for(lambda: len(runs_of(cluster, "healthy")) >= 3, 30, "the healthy schedule firing")
    listed = {x["name"]: x for x in json.loads(cli_ok(cluster, "schedule", "list", "--json"))["schedules"]}
    assert "RuntimeError: the warehouse is gone" in listed["broken"]["last_error"]
    assert listed["healthy"]["last_error"] is None and runs_of(cluster, "broken") == []
    assert len([f for f in firings(cluster, "broken") if f.state == "failed"]) >= 2  # tried at each instant
    assert b.popen.poll() is None and "schedule could not fire" in b.text()


def test_backfill_killed_part_way_and_run_again(cluster: Cluster, tmp_path: Path) -> None:
    """60 hourly instants (across the London spring-forward: 61 wall-clock hours) with --max-active
    3 and a worker: killed with -9 part-way, run again:
    60 runs, each instant once, never more than 3 running at once (from the database)."""
    cli_ok(
        cluster, "schedule", "add", "hourly", "--cron", "0 * * * *", "--tz", "Europe/London", "--paused",
        "--spec", spec(tmp_path, "hourly", "tasks.probes.sleep"),
    )  # fmt: skip
    cluster.worker("w1", concurrency=4)
    args = ["backfill", "hourly", "--start", "2026-03-28", "--end", "2026-03-30T13:00", "--max-active", "3", "--json"]
    dry = json.loads(cli_ok(cluster, *args, "--dry-run"))["logical_dates"]
    assert len(dry) == 60 and dry[:3] == [
        "2026-03-28T00:00:00+00:00",
        "2026-03-28T01:00:00+00:00",
        "2026-03-28T02:00:00+00:00",
    ]
    assert runs_of(cluster, "hourly") == []  # the dry run wrote nothing
    first = cluster._spawn("backfill-1", [sys.executable, "-m", "orchestrator.cli", *args], cluster.env())
    cluster.wait_for(lambda: len(runs_of(cluster, "hourly")) >= 15, 60, "15 runs of the backfill")
    first.signal_group(signal.SIGKILL)
    first.popen.wait(10)
    partial = len(runs_of(cluster, "hourly"))
    assert 15 <= partial < 60
    out = cluster.cli(*args, "--wait", timeout=240)
    assert out.returncode == 0, out.stderr + out.stdout[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])["summary"]
    assert summary["instants"] == 60 and summary["created"] == 60 - partial and summary["existing"] == partial
    runs = runs_of(cluster, "hourly")
    assert len(runs) == 60 and [r.logical_date for r in runs] == dry
    assert all(r.state == "SUCCEEDED" for r in runs)
    # never more than 3 running at once: replay created/finished
    edges = sorted([(r.created_at, 1) for r in runs] + [(r.finished_at, -1) for r in runs], key=lambda e: (e[0], e[1]))
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    assert most <= 3, most
    print(f"backfill: killed after {partial} of 60 runs; re-run created {summary['created']}; at most {most} running")


def test_beat_on_the_embedded_default_needs_no_server(tmp_path: Path) -> None:
    """The embedded PostgreSQL and the filesystem broker: `orchestrator beat` fires a schedule with no server."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env.update(ORCHESTRATOR_DATA_DIR=str(tmp_path / "data"), ORCHESTRATOR_BEAT_INTERVAL="0.5", PYTHONUNBUFFERED="1")
    env.update(ORCHESTRATOR_SCHEDULE_MIN_INTERVAL_SECONDS="0")
    cli = [sys.executable, "-m", "orchestrator.cli"]
    added = subprocess.run(
        [*cli, "schedule", "add", "embedded", "--every", "1", "--spec", spec(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    with (tmp_path / "beat.log").open("wb") as log:
        proc = subprocess.Popen([*cli, "beat"], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        runs: list[Any] = []
        while time.monotonic() < deadline and len(runs) < 3:
            time.sleep(0.5)
            out = subprocess.run(
                [*cli, "runs", "--json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
            )
            runs = json.loads(out.stdout)["runs"] if out.returncode == 0 else []
        assert len(runs) >= 3, (tmp_path / "beat.log").read_text()[-3000:]
    finally:
        stop_process(proc, timeout=15)
        stop_embedded(tmp_path / "data")
