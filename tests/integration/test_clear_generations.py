"""A map's source cleared while its children are QUEUED and RUNNING, on a real prefork worker
(issue 36, crossing 1).

The clear revokes the children's messages (the worker keeps their Celery task ids as revoked and
drops any message that carries one) and removes them; the source runs again and the map is
expanded again. Its new children's messages must carry new task ids: with the removed children's
ids, the worker dropped them and the reconciler re-published them once per dispatch timeout,
forever, and the run never ended.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, RunState, TaskState
from orchestrator.services.invariants import check_runs
from tests.integration.conftest import WorkerProcess

T = TaskState
pytestmark = pytest.mark.integration
D = "tasks.dynamic."


def until(check: Any, timeout: float, what: str) -> Any:
    """Poll the database (``check``) until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"not after {timeout}s: {what}")
        time.sleep(0.05)


def test_a_maps_source_cleared_while_its_children_run_finishes_with_new_task_ids(
    orc: Orchestrator, worker: WorkerProcess
) -> None:
    # Given ls -> m (6 children of 2 s each) -> join, with m's children QUEUED and RUNNING
    dag = DAG("clear-live-map")
    ls = dag.task("ls", D + "listing", kwargs={"n": 6})
    m = dag.map("m", D + "item", over=ls, kwarg="x", kwargs={"add": 10, "seconds": 2})
    dag.task("join", D + "collect", upstream=[m])
    run = orc.submit(dag)

    def live() -> dict[str, int]:
        kids = {t.key: t for t in run.tasks() if t.map_parent == "m"}
        states = Counter(t.state for t in kids.values())
        if states[T.RUNNING] and states[T.QUEUED]:
            return {k: t.attempt for k, t in kids.items() if t.state in (T.QUEUED, T.RUNNING)}
        return {}

    in_flight = until(live, 60, "m's children QUEUED and RUNNING")

    # When the source is cleared with its downstream while they are in flight
    cleared = orc.clear(run.id, "ls", downstream=True, by="dave")
    assert "ls" in cleared and "m" in cleared

    # Then the run ends SUCCEEDED (the old code: the new children's messages carried revoked ids,
    # the worker dropped them and the run never ended)
    assert run.wait(timeout=90).state is RunState.SUCCEEDED
    assert run.task("join").result == {"m": [i + 10 for i in range(6)]}
    events = run.events()
    removed_at = max(i for i, e in enumerate(events) if e.kind == "removed")
    old = {(e.key, e.attempt) for e in events[:removed_at] if e.key and e.key.startswith("m[") and e.kind is None}
    new = [e for e in events[removed_at:] if e.key and e.key.startswith("m[") and e.kind is None and e.accepted]
    # no message of the new generation reuses a task id of the removed one (those revoked included)
    dispatched = {(e.key, e.attempt) for e in new if e.to_state == "QUEUED"}
    assert dispatched and not dispatched & old, sorted(dispatched & old)
    assert not {k for k, a in dispatched if in_flight.get(k) == a}
    # each child committed once in the new generation, and at most once in the removed one
    assert Counter(e.key for e in new if e.to_state == "SUCCEEDED") == Counter(f"m[{i}]" for i in range(6))
    before = Counter(e.key for e in events[:removed_at] if e.accepted and e.to_state == "SUCCEEDED")
    assert all(n == 1 for k, n in before.items() if k.startswith("m[")), before
    assert check_runs(orc.store, [run.id]) == []
