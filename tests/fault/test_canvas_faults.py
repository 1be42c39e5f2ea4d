"""A Celery canvas under faults: the whole worker running a chord's header SIGKILLed mid-way.
Nothing is lost (the run ends with plain Celery's result, computed here by calling the same
bodies) and nothing is committed twice (one accepted success per task in the ledger)."""

from __future__ import annotations

import signal
from collections import Counter

import pytest

from orchestrator import RunState, TaskState
from tasks.canvas import PARTS, aggregate, extract, load, transform, workflow
from tests.fault.harness import Cluster, accepted

pytestmark = pytest.mark.fault
DAY = "2026-11-28"


def test_a_chord_survives_its_worker_killed_mid_header(cluster: Cluster, tmp_path: object) -> None:
    # Given a worker running a canvas whose chord header parts take a while
    w1 = cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(workflow(DAY, failures=f"{tmp_path}/failures", queue="orchestrator.default", pause=4))
    cluster.wait_task(run.id, "transform[0]", lambda t: t.state is TaskState.RUNNING, 60, "a header part running")

    # When the whole worker is SIGKILLed, and another starts
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    cluster.worker("w2", concurrency=2)

    # Then the run ends as plain Celery's would, each task committed once
    assert cluster.wait_run(run.id, 120) is RunState.SUCCEEDED
    rows = extract(DAY)
    expected = load(aggregate([transform(rows, part=i) for i in range(PARTS)]), table="revenue")
    assert cluster.store.reads.get_task(run.id, "load").result == expected
    # the killed worker's messages come back (as after kombu's visibility timeout): refused
    assert cluster.restore_unacked(run.id) >= 1
    cluster.assert_clean([run.id])
    commits = Counter(e.key for e in accepted(cluster.events(run.id), dst="SUCCEEDED"))
    assert set(commits.values()) == {1}, commits
    assert {k for k in commits} >= {"extract", "aggregate", "load", "stamp", *(f"transform[{i}]" for i in range(PARTS))}
