"""Runs pinned to a code version, end to end with real prefork workers: while only a worker of
``v1`` is live, a run submitted with ``code_version="v2"`` is held READY (nothing published) and
``explain`` names the missing version, while an unpinned run runs on the ``v1`` worker; once a
worker started with ``ORCHESTRATOR_CODE_VERSION=v2`` registers, the pinned run runs there, on its
own. ``orchestrator workers --json`` lists both workers with their versions and pinned queues.

(A task added to no worker is held and explained, then runs once a worker that has it starts:
``tests/integration/test_watchdog.py``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState
from orchestrator.store.schema import tasks as t
from orchestrator.store.schema import workers as w
from tests.integration.conftest import ROOT, OwnWorker, sql, until

pytestmark = pytest.mark.integration

Start = Callable[[str, str, str], str]


@pytest.fixture
def versioned(own_worker: OwnWorker) -> Start:
    """A worker of the test's own on ``queue`` advertising ``ORCHESTRATOR_CODE_VERSION=version``."""

    def start(tag: str, queue: str, version: str) -> str:
        return own_worker(tag, queue, ORCHESTRATOR_CODE_VERSION=version)[0]

    return start


def task_row(orc: Orchestrator, run_id: str) -> Any:
    return sql(orc, sa.select(t).where(t.c.run_id == run_id, t.c.key == "x"))[0]


def one_task(name: str, queue: str) -> DAG:
    dag = DAG(name)
    dag.task("x", "tasks.probes.noop", queue=queue)
    return dag


def listed_workers() -> dict[str, dict[str, Any]]:
    """``orchestrator workers --json`` as a user runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "workers", "--json"],
        cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return {found["name"]: found for found in json.loads(out.stdout)["workers"]}


def test_a_run_pinned_to_a_code_version_waits_for_a_worker_of_that_version(orc: Orchestrator, versioned: Start) -> None:
    tag = uuid.uuid4().hex[:6]
    queue = f"it-versions-{tag}"
    # Given only a worker of v1 on the queue
    v1 = versioned(f"ver-v1-{tag}", queue, "v1")
    (row,) = sql(orc, sa.select(w.c.code_version, w.c.queues).where(w.c.name == v1))
    assert row.code_version == "v1" and sorted(row.queues) == [queue, f"{queue}@v1"]
    # When a run pinned to v2 and an unpinned run are submitted
    pinned = orc.submit(one_task(f"it-versions-pinned-{tag}", queue), code_version="v2")
    plain = orc.submit(one_task(f"it-versions-plain-{tag}", queue))
    # Then the unpinned run runs on the v1 worker
    until("unpinned run finished", lambda: plain.status().state is RunState.SUCCEEDED)
    assert task_row(orc, plain.id).worker.startswith(v1)
    # and the pinned one is held READY on QUEUE@v2, never published, and explained
    held = task_row(orc, pinned.id)
    assert (held.state, held.queue, held.dispatched_at) == ("READY", f"{queue}@v2", None)
    reasons = {r.kind: r.detail for r in orc.explain(pinned.id, "x")[0].reasons}
    assert reasons.get("unregistered") == (
        f"no live worker of code version v2 on queue {queue} has task tasks.probes.noop registered"
        f" (workers on {queue}: {v1} (version v1))"
    ), reasons

    # When a worker of v2 starts, the pinned run runs there without anyone acting
    v2 = versioned(f"ver-v2-{tag}", queue, "v2")
    until("pinned run finished", lambda: pinned.status().state is RunState.SUCCEEDED)
    assert task_row(orc, pinned.id).worker.startswith(v2)
    # and `orchestrator workers` lists both, with their versions and pinned queues
    listed = listed_workers()
    assert (listed[v1]["code_version"], listed[v1]["queues"]) == ("v1", [queue, f"{queue}@v1"])
    assert (listed[v2]["code_version"], listed[v2]["queues"]) == ("v2", [queue, f"{queue}@v2"])
    assert "tasks.probes.noop" in listed[v2]["tasks"] and listed[v2]["task_count"] == len(listed[v2]["tasks"])
