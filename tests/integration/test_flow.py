"""Keyed flow control on a real prefork worker (issue 34), each decision read back from the
database: a burst of 100 submissions with a debounce becomes one run (99 merged, each a ledger
row naming the run it merged into); a busy key with ``skip``, ``cancel_running`` and
``replace_queued`` does as named; ``queue`` runs the held run once the key frees (the worker's
reconciler releases it); a throttle of 10/minute holds the 11th run with its next slot."""

from __future__ import annotations

import datetime as dt
import itertools
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState
from orchestrator.store import schema as s
from tests.integration.conftest import WorkerProcess, sql, until

pytestmark = pytest.mark.integration
P = "tasks.probes."


def fine(name: str = "flow-fine") -> DAG:
    dag = DAG(name)
    dag.task("work", P + "noop")
    return dag


def slow(seconds: float, name: str = "flow-slow") -> DAG:
    dag = DAG(name)
    dag.task("work", P + "sleep", kwargs={"seconds": seconds})
    return dag


def key() -> str:
    return f"customer:{uuid.uuid4().hex[:10]}"


def held(orc: Orchestrator, run_id: str) -> Any:
    return sql(orc, sa.select(s.runs.c.held, s.runs.c.held_until).where(s.runs.c.id == run_id))[0]


def run_rows(orc: Orchestrator, run_id: str) -> list[tuple[Any, ...]]:
    """The run-level ledger rows of ``run_id``: (kind, to_state, reason), oldest first."""
    e = s.events.c
    query = sa.select(e.kind, e.to_state, e.reason).where(e.run_id == run_id, e.key.is_(None)).order_by(e.id)
    return [tuple(r) for r in sql(orc, query)]


def running(orc: Orchestrator, run_id: str) -> bool:
    t = s.tasks.c
    return bool(sql(orc, sa.select(t.key).where(t.run_id == run_id, t.state == "RUNNING")))


def test_a_burst_of_100_debounced_submissions_is_one_run(orc: Orchestrator, worker: WorkerProcess) -> None:
    k = key()
    ids = [orc.submit(fine("flow-debounce"), concurrency_key=k, debounce=3).id for _ in range(100)]
    last = ids[-1]
    until("the burst's run SUCCEEDED", lambda: orc.run_state(last) is RunState.SUCCEEDED, timeout=120)
    r = s.runs.c
    states = sql(orc, sa.select(r.state, sa.func.count()).where(r.flow_key == k).group_by(r.state))
    assert dict(states) == {"SUCCEEDED": 1, "CANCELLED": 99}
    for before, after in itertools.pairwise(ids):
        assert (None, "CANCELLED", f"merged into run {after} (debounce on key {k})") in run_rows(orc, before)
    kinds = [kind for kind, _, _ in run_rows(orc, last)]
    assert "held" in kinds and "released" in kinds


def test_a_busy_key_skips_cancels_or_replaces(orc: Orchestrator, worker: WorkerProcess) -> None:
    k = key()
    first = orc.submit(slow(120), concurrency_key=k).id
    until("the first run's task RUNNING", lambda: running(orc, first))
    # skip: the new submission is cancelled at once, with its reason
    skipped = orc.submit(fine(), concurrency_key=k, on_busy="skip").id
    assert orc.run_state(skipped) is RunState.CANCELLED
    assert (None, "CANCELLED", f"skipped: concurrency key {k} busy (1 running: {first})") in run_rows(orc, skipped)
    # replace_queued: the held run is cancelled, the latest is held in its place
    queued = orc.submit(fine(), concurrency_key=k, on_busy="replace_queued").id
    latest = orc.submit(fine(), concurrency_key=k, on_busy="replace_queued").id
    assert orc.run_state(queued) is RunState.CANCELLED
    assert (None, "CANCELLED", f"replaced by run {latest} (concurrency key {k})") in run_rows(orc, queued)
    assert held(orc, latest)[0] == "concurrency"
    # cancel_running: the running run (and its task on the worker) cancelled, the held one replaced,
    # the newest one runs
    newest = orc.submit(fine(), concurrency_key=k, on_busy="cancel_running").id
    assert orc.run_state(first) is RunState.CANCELLED
    assert any(kind == "held" and reason and f"run {newest} took" in reason for kind, _, reason in run_rows(orc, first))
    assert (None, "CANCELLED", f"replaced by run {newest} (concurrency key {k})") in run_rows(orc, latest)
    until("the newest run SUCCEEDED", lambda: orc.run_state(newest) is RunState.SUCCEEDED)
    assert orc.run_state(first) is RunState.CANCELLED and orc.run_state(skipped) is RunState.CANCELLED
    assert orc.run_state(latest) is RunState.CANCELLED


def test_queue_runs_the_held_run_when_the_key_frees(orc: Orchestrator, worker: WorkerProcess) -> None:
    k = key()
    first = orc.submit(slow(1), concurrency_key=k).id
    second = orc.submit(fine(), concurrency_key=k).id
    assert held(orc, second)[0] == "concurrency"
    until("the queued run SUCCEEDED", lambda: orc.run_state(second) is RunState.SUCCEEDED, timeout=120)
    assert orc.run_state(first) is RunState.SUCCEEDED
    released = [r for kind, _, r in run_rows(orc, second) if kind == "released"]
    assert released == [f"released: concurrency key {k} (concurrency hold over)"]


def test_a_throttle_of_10_a_minute_holds_the_11th(orc: Orchestrator, worker: WorkerProcess) -> None:
    k = key()
    ids = [orc.submit(fine("flow-throttle"), concurrency_key=k, throttle="10/minute").id for _ in range(11)]
    try:
        until("ten runs SUCCEEDED", lambda: all(orc.run_state(i) is RunState.SUCCEEDED for i in ids[:10]), 120)
        reason, until_at = held(orc, ids[10])
        assert reason == "throttle" and orc.run_state(ids[10]) is RunState.RUNNING
        first_admitted = sql(orc, sa.select(s.runs.c.flow_admitted_at).where(s.runs.c.id == ids[0]))[0][0]
        assert until_at == first_admitted + dt.timedelta(seconds=60)
        reasons = [r for kind, _, r in run_rows(orc, ids[10]) if kind == "held"]
        assert reasons == [f"throttled: next slot at {until_at.isoformat(timespec='seconds')} (key {k})"]
        assert {t.state.value for t in orc.tasks(ids[10])} == {"PENDING"}
    finally:
        orc.cancel(ids[10], by="test")
