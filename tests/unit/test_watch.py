"""``orchestrator watch``: the live view's frames, read from the database (SQLite)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

from rich.console import Console

from orchestrator import DAG, RunState
from orchestrator.cli.watch import watch
from tests.unit.test_web import finish, make_orc


def test_watch_follows_a_run_to_its_end(tmp_path: Path) -> None:
    orc = make_orc(tmp_path)
    try:
        dag = DAG("watched")
        a = dag.task("a", "t.ok")
        dag.task("b", "t.fail", upstream=[a])
        dag.task("c", "t.ok", upstream=[a])
        run = orc.submit(dag)
        out = io.StringIO()
        console = Console(file=out, force_terminal=True, width=120, color_system=None)
        worker = threading.Timer(0.6, lambda: finish(orc, fail={"b"}))
        worker.start()
        started = time.monotonic()
        state = watch(orc, run.id, poll=0.1, timeout=30, console=console)
        worker.join()
        text = out.getvalue()
        assert state is RunState.FAILED and time.monotonic() - started < 10
        # the first frames show the run open, the last one final, with counts and events
        assert "0/3 final" in text and "3/3 final" in text
        assert "succeeded 2" in text and "failed 1" in text
        assert "RUNNING -> FAILED" in text and "(run)" in text
    finally:
        orc.store.dispose()


def test_watch_gives_up_after_its_timeout(tmp_path: Path) -> None:
    orc = make_orc(tmp_path)
    try:
        dag = DAG("slow")
        dag.task("a", "t.ok")
        run = orc.submit(dag)
        out = io.StringIO()
        state = watch(orc, run.id, poll=0.05, timeout=0.3, console=Console(file=out, width=100))
        assert state is RunState.RUNNING and "0/1 final" in out.getvalue()
    finally:
        orc.store.dispose()


def test_task_text_is_never_read_as_markup() -> None:
    import datetime as dt

    from orchestrator.cli.watch import view
    from orchestrator.core.models import EventView, RunView

    now = dt.datetime.now(dt.UTC)
    run = RunView("r1", "d", "default", RunState.RUNNING, "default", None, {}, 1, 1, now, None, {})
    event = EventView("k", 1, "RUNNING", "RETRYING", "worker", "bad path [/etc/x] [bold]", True, now)
    out = io.StringIO()
    Console(file=out, width=120).print(view(run, [], [event], now))
    assert "bad path [/etc/x] [bold]" in out.getvalue()
