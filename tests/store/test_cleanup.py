"""Pruning finished runs (``orchestrator db clean``, issue 21): only final runs created and
finished before the cut-off go, with their tasks, edges and ledger; RUNNING runs and newer ones
stay; batches; an archive holds everything removed; a run reopened by a clear is never half
removed."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator
from orchestrator.store import schema as s
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

    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base

    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
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


# --------------------------------------------------------------- the archive on a full disk (issue 36, crossing 5)


@pytest.fixture
def full_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder on a filesystem of 64 KiB (a tmpfs: the tests run as root in CI) filled up to its
    last three pages, so that an archive of a run or two fills it; where no tmpfs can be mounted, a
    folder whose ``a.jsonl`` is ``/dev/full`` (every write fails with ENOSPC)."""
    import subprocess

    folder = tmp_path / "full"
    folder.mkdir()
    mounted = os.geteuid() == 0 and (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True).returncode
        == 0
    )
    if mounted:
        room = os.statvfs(folder)
        (folder / "filler").write_bytes(b"\0" * (room.f_bavail * room.f_frsize - 3 * 4096))
    else:
        (folder / "a.jsonl").symlink_to("/dev/full")
    try:
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)


def padded(i: int) -> DAG:
    """A one-task run that takes ~2.5 KB of archive (its snapshot and its task's arguments)."""
    dag = DAG(f"padded{i}")
    dag.task("a", "t", kwargs={"pad": "x" * 1000})
    return dag


def archived_ids(path: Path) -> list[str]:
    """The runs of the archive's whole lines."""
    if path.is_symlink():
        return []
    found = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n"):
            found.append(json.loads(line)["run"]["id"])
    return found


def test_a_full_archive_deletes_nothing_it_did_not_write(orc: Orchestrator, full_dir: Path) -> None:
    """Given old runs and an archive on a full filesystem, when a clean fails to write a batch
    to it, then the runs of that batch are all still there: each run is gone exactly when the
    archive holds it (the batch's archive is written and flushed before its delete commits)."""
    from orchestrator.store.cleanup import ArchiveError

    ids = [drive(orc, padded(i)).run_id for i in range(6)]
    for run_id in ids:
        age(orc, run_id, 10)
    cut = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    path = full_dir / "a.jsonl"
    out = open(path, "a", encoding="utf-8")  # its close fails too: the stream keeps what it could not write
    with pytest.raises(ArchiveError, match="No space left on device"):
        orc.store.cleanup.clean(cut, batch=1, archive=out)
    with contextlib.suppress(OSError):
        out.close()
    left = {r.id for r in orc.runs(limit=10)}
    assert left, "the filesystem held every run: the test needs a smaller one"
    assert set(ids) - left <= set(archived_ids(path))


def test_a_clean_to_a_full_archive_file_by_path(orc: Orchestrator, full_dir: Path) -> None:
    """By path (what the command line gives), a failed batch's part is cut off again: the
    archive's lines are exactly the runs removed, each whole."""
    from orchestrator.store.cleanup import ArchiveError

    ids = [drive(orc, padded(i)).run_id for i in range(6)]
    for run_id in ids:
        age(orc, run_id, 10)
    cut = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    path = full_dir / "a.jsonl"
    with pytest.raises(ArchiveError) as failed:
        orc.store.cleanup.clean(cut, batch=1, archive=path)
    left = {r.id for r in orc.runs(limit=10)}
    assert left and sorted(set(ids) - left) == sorted(archived_ids(path))
    assert failed.value.cleaned.runs == len(ids) - len(left)
    assert path.is_symlink() or failed.value.cleaned.runs >= 1  # the batches that fitted stay removed


def test_db_clean_errors_are_one_line_and_delete_nothing(
    orc: Orchestrator, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, full_dir: Path
) -> None:
    """The command line: a full archive, an archive in a missing folder and a cut-off too far
    back are each one ``error: ...`` line, exit 2, no traceback; nothing the archive does not
    hold is removed."""
    from click.testing import CliRunner

    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base

    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    runner = CliRunner()
    ids = [drive(orc, padded(i)).run_id for i in range(6)]
    for run_id in ids:
        age(orc, run_id, 40)
    full = runner.invoke(
        cli.main, ["db", "clean", "--before", "30d", "--batch", "1", "--archive", str(full_dir / "a.jsonl")]
    )
    lines = full.stderr.splitlines()
    assert full.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), full.output
    assert "No space left on device" in lines[0] and "Traceback" not in full.output
    left = {r.id for r in orc.runs(limit=10)}
    assert left and sorted(set(ids) - left) == sorted(archived_ids(full_dir / "a.jsonl"))
    for args in (
        ["--before", "30d", "--archive", str(tmp_path / "missing" / "a.jsonl")],
        ["--before", "999999d"],
        ["--before", "0001-01-01T00:00:00+14:00"],
    ):
        bad = runner.invoke(cli.main, ["db", "clean", *args])
        lines = bad.stderr.splitlines()
        assert bad.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, bad.output)
        assert {r.id for r in orc.runs(limit=10)} == left
    assert (
        "missing"
        in runner.invoke(
            cli.main, ["db", "clean", "--before", "30d", "--archive", str(tmp_path / "missing" / "a.jsonl")]
        ).stderr
    )


# ------------------------------------------------- idempotency keys outlive the runs (issue 36, crossing 6)


def test_a_removed_runs_idempotency_key_is_kept_and_refused(orc: Orchestrator) -> None:
    """Given a run submitted with an idempotency key and removed by a clean, when the client
    retries the request with that key, then it is refused naming the removed run and no second
    run starts; once the key's retention is past, a clean forgets it and the key is free again."""
    from orchestrator import IdempotencyConflict

    first = drive(orc, chain(), run_id=orc.submit(chain(), idempotency_key="order-1").id).run_id
    other = drive(orc, chain("other")).run_id  # no key: nothing kept
    fired = drive(orc, chain("fired"), run_id=orc.submit(chain("fired"), idempotency_key="schedule:s:1").id).run_id
    with orc.store.engine.begin() as conn:  # as if a schedule had fired it: a backfill makes it again
        conn.execute(s.runs.update().where(s.runs.c.id == fired).values(schedule="s"))
    for run_id in (first, other, fired):
        age(orc, run_id, 40)
    cut = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    assert orc.store.cleanup.count(cut).keys_kept == 1
    done = orc.store.cleanup.clean(cut)
    assert (done.runs, done.keys_kept, done.keys_forgotten) == (3, 1, 0)
    with pytest.raises(IdempotencyConflict, match=f"run {first}.*removed") as refused:
        orc.submit(chain(), idempotency_key="order-1")
    assert refused.value.run_id == first
    assert orc.runs(limit=10) == []
    assert orc.submit(chain("fired"), idempotency_key="schedule:s:1").id != fired
    # the key is per DAG and tenant, as before
    assert orc.submit(chain("c2"), idempotency_key="order-1").id != first
    # a clean keeps it for its retention, then forgets it
    assert orc.store.cleanup.clean(cut).keys_forgotten == 0
    assert orc.store.cleanup.clean(cut, keep_keys=dt.timedelta(0)).keys_forgotten == 1
    again = orc.submit(chain(), idempotency_key="order-1")
    assert again.id != first


def test_db_clean_keep_keys(orc: Orchestrator, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base

    monkeypatch.setattr(cli_base, "_ready_store", lambda: orc)
    runner = CliRunner()
    run_id = drive(orc, chain(), run_id=orc.submit(chain(), idempotency_key="k").id).run_id
    age(orc, run_id, 40)
    done = runner.invoke(cli.main, ["db", "clean", "--before", "30d"])
    assert done.exit_code == 0 and "1 idempotency key(s) kept" in done.output, done.output
    refused = runner.invoke(cli.main, ["db", "clean", "--before", "30d", "--keep-keys", "soon"])
    assert refused.exit_code == 2 and refused.stderr.startswith("error: --keep-keys"), refused.output
    forgot = runner.invoke(cli.main, ["db", "clean", "--before", "30d", "--keep-keys", "0d", "--json"])
    assert json.loads(forgot.stdout)["keys_forgotten"] == 1, forgot.output
