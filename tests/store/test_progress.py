"""Progress reports (``update_state``) in ``orc_progress``: fenced by attempt, shown for the
current attempt only, size-bounded, throttled per attempt with the last report kept, removed
with their run by ``db clean``."""

from __future__ import annotations

import datetime as dt
import io
import json
import time

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.core.errors import ValidationError
from orchestrator.core.protocol import FencingToken
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import default_queues
from orchestrator.runtime.progress import Reporter


@pytest.fixture
def orc(pg_clean: str) -> Orchestrator:
    settings = Settings(database_url=pg_clean, progress_interval=0.5, max_progress_bytes=200)
    orc = Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(["t"]))
    orc.register_worker("w", default_queues(), 10)
    return orc


def running(orc: Orchestrator) -> tuple[str, FencingToken]:
    dag = DAG("progress")
    dag.task("a", "t", max_attempts=3)
    run = orc.submit(dag)
    (d,) = orc.publisher.take()  # type: ignore[attr-defined]
    assert orc.claim(d.token, "w:1", "t") is not None
    return run.id, d.token


def test_a_report_is_fenced_by_its_attempt_and_shown_for_the_current_one_only(orc: Orchestrator) -> None:
    run_id, token = running(orc)
    assert orc.record_progress(token, "PROGRESS", {"done": 1})
    assert orc.record_progress(token, "PROGRESS", {"done": 2})  # overwritten, one row
    shown = orc.progress(run_id)["a"]
    assert (shown.state, shown.meta, shown.attempt) == ("PROGRESS", {"done": 2}, 1)
    # cleared: attempt 2 is PENDING again; attempt 1's late report is refused and none is shown
    orc.clear(run_id, "a")
    assert not orc.record_progress(token, "PROGRESS", {"done": 3})
    assert orc.progress(run_id) == {}
    stale = FencingToken(run_id, "a", 7)
    assert not orc.record_progress(stale, "PROGRESS", None)


def test_a_report_must_be_small_plain_json_with_a_short_state(orc: Orchestrator) -> None:
    _, token = running(orc)
    with pytest.raises(ValidationError, match="ORCHESTRATOR_MAX_PROGRESS_BYTES=200"):
        orc.record_progress(token, "PROGRESS", {"blob": "x" * 300})
    with pytest.raises(ValidationError, match="JSON"):
        orc.record_progress(token, "PROGRESS", {"when": object()})
    with pytest.raises(ValidationError, match="1-64 characters"):
        orc.record_progress(token, "", None)


def test_a_tight_loop_writes_once_per_interval_and_its_last_report_before_the_outcome(orc: Orchestrator) -> None:
    run_id, token = running(orc)
    now = [100.0]
    reporter = Reporter(clock=lambda: now[0])
    for i in range(1000):  # a tight loop: one write, the rest pending (the latest kept)
        reporter.report(orc, token, "PROGRESS", {"i": i})
    assert reporter.writes == 1 and orc.progress(run_id)["a"].meta == {"i": 0}
    now[0] += 0.6  # the interval is up: the next report is written at once
    reporter.report(orc, token, "PROGRESS", {"i": 1000})
    assert reporter.writes == 2 and orc.progress(run_id)["a"].meta == {"i": 1000}
    reporter.report(orc, token, "PROGRESS", {"i": 1001})  # pending
    reporter.finish(orc, token)  # the body ended: its last report is written before the outcome
    assert reporter.writes == 3 and orc.progress(run_id)["a"].meta == {"i": 1001}
    with pytest.raises(ValidationError):  # checked at once, even inside the interval
        reporter.report(orc, token, "PROGRESS", {"blob": "x" * 300})


def test_the_pending_report_is_written_when_its_interval_is_up(orc: Orchestrator) -> None:
    run_id, token = running(orc)
    reporter = Reporter()
    reporter.report(orc, token, "PROGRESS", {"i": 0})
    reporter.report(orc, token, "PROGRESS", {"i": 1})  # pending: a timer writes it
    deadline = time.monotonic() + 30
    while orc.progress(run_id)["a"].meta != {"i": 1}:
        assert time.monotonic() < deadline, "the pending report was never written"
        time.sleep(0.05)
    reporter.finish(orc, token)


def test_db_clean_removes_a_runs_progress_and_archives_it(orc: Orchestrator) -> None:
    run_id, token = running(orc)
    assert orc.record_progress(token, "PROGRESS", {"done": 1})
    orc.cancel(run_id)
    out = io.StringIO()
    cleaned = orc.store.cleanup.clean(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5), archive=out)
    assert cleaned.runs == 1
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM orc_progress")).scalar_one() == 0
    # the archive holds everything removed, the last report too
    (line,) = out.getvalue().splitlines()
    (kept,) = json.loads(line)["progress"]
    assert (kept["key"], kept["attempt"], kept["state"], kept["meta"]) == ("a", 1, "PROGRESS", {"done": 1})
