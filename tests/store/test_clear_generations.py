"""A map's source cleared while its children are QUEUED or RUNNING (issue 36, crossing 1).

The clear fences and revokes the children's attempts and removes them; when the source succeeds
again the map is expanded again. Its new children must not reuse any Celery task id of the
removed ones (workers drop a revoked id: the re-published message would be dropped forever), and
an old generation's message still in flight must never claim or finish the new generation's row.
The workers' part is played by ``dynamic.drive`` and direct store calls; the publisher records
every dispatch and every revoke.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator
from orchestrator.core.models import Claim
from orchestrator.core.protocol import task_id
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.services.invariants import check_runs
from tests.store.dynamic import drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def mapped(chained: bool) -> DAG:
    dag = DAG("regen")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x")
    last = "m"
    if chained:
        dag.map("m2", "t", over="m", kwarg="y")
        last = "m2"
    dag.task("join", "up", upstream=[last])
    return dag


def body(listing: list[int]) -> Any:
    def run(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return list(listing)
        if key.startswith("m["):
            return kw["x"] * 10
        if key.startswith("m2["):
            return kw["y"] + 1
        return up

    return run


def states(orc: Orchestrator, run_id: str) -> dict[str, str]:
    return {t.key: t.state.value for t in orc.tasks(run_id)}


def dispatched(orc: Orchestrator, run_id: str, after: int = 0) -> dict[str, int]:
    """The Celery task id of every message admission made for the run (its accepted moves to
    QUEUED) from the ledger's row number ``after`` on, with that row's number."""
    return {
        task_id(run_id, e.key, e.attempt): i
        for i, e in enumerate(orc.ledger(run_id))
        if i >= after and e.key is not None and e.kind is None and e.to_state == "QUEUED" and e.accepted
    }


@pytest.mark.parametrize("shape", ["plain", "chained", "windowed"])
def test_a_map_expanded_again_never_reuses_a_revoked_task_id_and_old_messages_are_refused(
    orc: Orchestrator, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    import orchestrator.core.dag.bounds

    if shape == "windowed":
        monkeypatch.setattr(orchestrator.core.dag.bounds, "MAP_WINDOW", 2)
    dag = mapped(chained=shape == "chained")
    store, publisher = orc.store, orc.publisher
    assert isinstance(publisher, RecordingPublisher)
    # Given: ls succeeded and m's children are QUEUED, one of them RUNNING (and, chained, one of
    # m2's children QUEUED behind its item)
    listing = [1, 2, 3, 4]
    d = drive(orc, dag, body(listing), until=lambda dr: any(k.startswith("m[") for k, _, _ in dr.ran))
    run_id = d.run_id
    store.admission.admit_ready(10_000)
    first = {t.key: t for t in orc.tasks(run_id) if t.map_parent is not None}
    running = next(k for k, t in sorted(first.items()) if t.state.value == "QUEUED" and k.startswith("m["))
    old = first[running].attempt
    assert isinstance(store.attempts.claim(run_id, running, old, "w:old", 60.0, "t"), Claim)
    live = states(orc, run_id)
    assert live[running] == "RUNNING" and "QUEUED" in {live[k] for k in first if k != running}
    # every task id any message of this run carried so far (the generation about to be removed)
    earlier = dispatched(orc, run_id)
    mark = len(orc.ledger(run_id))

    # When: the source is cleared with its downstream (its data changed)
    listing[:] = [5, 6, 7, 8]
    orc.clear(run_id, "ls", downstream=True, by="dave")
    revoked = set(publisher.revoked)
    assert task_id(run_id, running, old) in revoked and len(revoked) >= 2
    # ... and ls runs again: m is expanded again, its new children admitted
    d = drive(orc, dag, body(listing), run_id=run_id, until=lambda dr: states(orc, run_id)["m"] == "MAPPED")
    store.admission.admit_ready(10_000)
    new = {t.key: t for t in orc.tasks(run_id) if t.map_parent is not None and t.state.value == "QUEUED"}
    assert new and running in new

    # Then: no message of the new generation carries a revoked id, nor any id the removed one used
    sent = set(dispatched(orc, run_id, after=mark))
    assert task_id(run_id, running, new[running].attempt) in sent
    assert not sent & revoked, sorted(sent & revoked)
    assert not sent & set(earlier), sorted(sent & set(earlier))
    # the old generation's messages are fenced: its claim, heartbeat and late result are refused
    assert new[running].attempt > old
    assert not isinstance(store.attempts.claim(run_id, running, old, "w:late", 60.0, "t"), Claim)
    assert not store.attempts.heartbeat(run_id, running, old, 60.0)
    assert not store.attempts.succeed(run_id, running, old, "stale", 10).accepted
    assert states(orc, run_id)[running] == "QUEUED"
    for key, t in first.items():
        if t.state.value == "QUEUED":
            assert not isinstance(store.attempts.claim(run_id, key, t.attempt, "w:late", 60.0, "t"), Claim)

    # the run then finishes with each child committed once per generation
    d = drive(orc, dag, body(listing), run_id=run_id)
    assert d.run_state() == "SUCCEEDED"
    assert not set(dispatched(orc, run_id, after=mark)) & (revoked | set(earlier))
    children = [k for k in states(orc, run_id) if k.startswith("m[")]
    assert sorted(children) == [f"m[{i}]" for i in range(4)]
    assert d.ran[-1][0] == "join"
    assert orc.task(run_id, "join").result == (
        {"m2": [51, 61, 71, 81]} if shape == "chained" else {"m": [50, 60, 70, 80]}
    )
    assert check_runs(orc.store, [run_id]) == []


def test_a_child_expanded_again_keeps_its_whole_retry_budget(orc: Orchestrator) -> None:
    """Its first attempt continues after the removed child's, and its max_attempts moves with it."""
    dag = DAG("budget")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x", max_attempts=3)
    d = drive(orc, dag, body([1]), until=lambda dr: any(k == "m[0]" for k, _, _ in dr.ran))
    orc.store.admission.admit_ready(10_000)
    before = orc.task(d.run_id, "m[0]")
    orc.clear(d.run_id, "ls", downstream=True)
    drive(orc, dag, body([1]), run_id=d.run_id, until=lambda dr: states(orc, d.run_id)["m"] == "MAPPED")
    again = orc.task(d.run_id, "m[0]")
    assert again.attempt == before.attempt + 1
    assert again.max_attempts - again.attempt == before.max_attempts - 1


def test_verify_reports_a_child_expanded_again_at_an_attempt_an_earlier_generation_used(orc: Orchestrator) -> None:
    """What the old code wrote (the new child at attempt 1 again) is a violation ``verify`` names."""
    dag = mapped(chained=False)
    d = drive(orc, dag, body([1, 2]), until=lambda dr: any(k.startswith("m[") for k, _, _ in dr.ran))
    orc.store.admission.admit_ready(10_000)
    orc.clear(d.run_id, "ls", downstream=True)
    d = drive(orc, dag, body([1, 2]), run_id=d.run_id)
    assert d.run_state() == "SUCCEEDED" and check_runs(orc.store, [d.run_id]) == []
    with orc.store.engine.begin() as conn:
        removed = conn.exec_driver_sql(
            "SELECT max(id) FROM orc_task_events WHERE run_id = %s AND kind = 'removed'", (d.run_id,)
        ).scalar_one()
        conn.exec_driver_sql(
            "UPDATE orc_task_events SET attempt = 1 WHERE run_id = %s AND key = 'm[1]' AND id > %s", (d.run_id, removed)
        )
        conn.exec_driver_sql("UPDATE orc_tasks SET attempt = 1 WHERE run_id = %s AND key = 'm[1]'", (d.run_id,))
    problems = check_runs(orc.store, [d.run_id])
    assert problems == [f"{d.run_id}.m[1]: expanded again at attempt 1, which an earlier generation used"
                        " (its Celery task id repeats one the clear revoked)"]  # fmt: skip
