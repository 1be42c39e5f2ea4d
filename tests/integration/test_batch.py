"""An event trigger's ``batch`` on a real prefork worker (issue 34): 250 events with
``batch=(100, "2s")`` become 3 runs holding 100, 100 and 50 events (the worker's reconciler
releases the full ones at once and the last when its window is over), every event in exactly one
run's ``events`` list and every merged submission a CANCELLED run with its ledger row, all read
back from the database."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator
from orchestrator.store import schema as s
from tests.integration.conftest import WorkerProcess, sql, until

pytestmark = pytest.mark.integration


def test_250_events_with_a_batch_of_100_or_2s_are_three_runs(orc: Orchestrator, worker: WorkerProcess) -> None:
    name = f"batch-{uuid.uuid4().hex[:8]}"
    event = f"orders.{name}"
    dag = DAG("flow-batch")
    dag.task("work", "tasks.probes.noop")
    orc.triggers.add(name, event=event, spec=dag, batch=(100, "2s"))
    began = time.monotonic()
    for n in range(250):
        orc.store.waits.emit("default", event, json.dumps({"order": n}), f"{name}-{n}", None, "test", 10)
    wrote = time.monotonic() - began
    orc.triggers.tick()
    emitting = time.monotonic() - began
    r = s.runs.c

    def succeeded() -> list[sa.Row[tuple[str, dict[str, object]]]]:
        rows = sql(orc, sa.select(r.id, r.params).where(r.trigger == name, r.state == "SUCCEEDED"))
        return rows if sum(len(p["events"]) for _, p in rows) == 250 else []

    found = until("every event in a SUCCEEDED run", succeeded, timeout=120)
    sizes = sorted((len(p["events"]) for _, p in found), reverse=True)
    assert sizes == [100, 100, 50], f"writing took {wrote:.1f}s, firing {emitting:.1f}s"
    orders = Counter(e["order"] for _, p in found for e in p["events"])
    assert orders == Counter(range(250))  # every event in exactly one run's list
    states = dict(sql(orc, sa.select(r.state, sa.func.count()).where(r.trigger == name).group_by(r.state)))
    assert states == {"SUCCEEDED": 3, "CANCELLED": 247}
    e = s.events.c
    merged = sql(
        orc,
        sa.select(e.reason).where(
            e.run_id.in_(sa.select(r.id).where(r.trigger == name, r.state == "CANCELLED")),
            e.key.is_(None),
            e.to_state == "CANCELLED",
        ),
    )
    ids = {run_id for run_id, _ in found}
    assert len(merged) == 247
    assert all(m.startswith("merged into run ") and m.split()[3] in ids for (m,) in merged)
    released = sql(orc, sa.select(e.reason).where(e.run_id.in_(ids), e.kind == "released"))
    assert len(released) == 3
