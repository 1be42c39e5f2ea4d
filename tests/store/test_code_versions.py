"""Code versions and pinned runs, on the store (workers played by store calls, no Celery): a worker
registers its code version and its pinned ``QUEUE@VERSION`` queues with its task names; a run
submitted with ``code_version=V`` is held READY (nothing published) and explained until a live
worker of V that has its task registers, while an unpinned run goes to any worker; the watchdog
names the version; the workers listing (``orchestrator workers``: ``test_workers_cli.py``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.core.errors import ValidationError
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from orchestrator.core.routing import tenant_queues
from orchestrator.core.workers import pinned_queues
from orchestrator.store import Store
from orchestrator.store import schema as s

pytestmark = pytest.mark.postgres

Q = "orchestrator.default"


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    store = Store(pg_clean)
    o = Orchestrator(
        Settings(database_url=pg_clean, dispatch_timeout=0.0, tick_seconds=0.0),
        store=store,
        publisher=RecordingPublisher(),
        registry=StaticRegistry(["t", "u"]),
    )
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def register(
    orc: Orchestrator, name: str, version: str, tasks: list[str] | None, queues: tuple[str, ...] = (Q,)
) -> None:
    """A worker of ``version`` as the runtime registers it: its queues and their pinned ones."""
    orc.register_worker(name, [*queues, *pinned_queues(queues, version)], 2, tasks, code_version=version)


def one_task(task: str = "t") -> DAG:
    dag = DAG("versioned")
    dag.task("x", task)
    return dag


def row(orc: Orchestrator, run_id: str) -> Any:
    with orc.store.engine.connect() as conn:
        return conn.execute(sa.select(s.tasks).where(s.tasks.c.run_id == run_id, s.tasks.c.key == "x")).one()


def reasons(orc: Orchestrator, run_id: str) -> dict[str, Any]:
    return {r.kind: r for r in orc.explain(run_id, "x")[0].reasons}


def published(orc: Orchestrator) -> list[tuple[str, str]]:
    publisher = orc.publisher
    assert isinstance(publisher, RecordingPublisher)
    return [(d.run_id, d.queue) for d in publisher.sent]


def test_a_worker_registers_its_code_version_and_pinned_queues_with_its_task_names(orc: Orchestrator) -> None:
    register(orc, "w1", "v1", ["t"], (Q, "custom"))
    with orc.store.engine.connect() as conn:
        worker = conn.execute(sa.select(s.workers).where(s.workers.c.name == "w1")).one()
        names = conn.execute(
            sa.select(s.worker_tasks.c.queue, s.worker_tasks.c.task_name).where(s.worker_tasks.c.worker == "w1")
        ).all()
    assert worker.code_version == "v1"
    assert sorted(worker.queues) == sorted([Q, "custom", f"{Q}@v1", "custom@v1"])
    assert sorted(names) == sorted([(Q, "t"), ("custom", "t"), (f"{Q}@v1", "t"), ("custom@v1", "t")])
    # a heartbeat keeps the version; one that comes after the row went registers it again with it
    orc.touch_worker("w1", [Q], 2, ["t"], code_version="v1")
    orc.unregister_worker("w1")
    orc.touch_worker("w1", [Q, f"{Q}@v1"], 2, ["t"], code_version="v1")
    [view] = orc.list_workers()
    assert (view.name, view.code_version, view.queues, view.tasks) == ("w1", "v1", [Q, f"{Q}@v1"], ["t"])


def test_a_pinned_run_waits_for_a_worker_of_its_version_and_an_unpinned_one_runs_anywhere(orc: Orchestrator) -> None:
    # Given only a worker of v1, which has every task
    register(orc, "w-v1", "v1", ["t", "u"])
    # When a run pinned to v2 and an unpinned run are submitted
    pinned = orc.submit(one_task(), code_version="v2")
    plain = orc.submit(one_task())
    # Then the unpinned run goes to the v1 worker's queue, the pinned one is held READY on Q@v2
    assert row(orc, plain.id).state == "QUEUED"
    held = row(orc, pinned.id)
    assert (held.state, held.queue) == ("READY", f"{Q}@v2")
    assert [q for run_id, q in published(orc) if run_id == pinned.id] == []
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.select(s.runs.c.code_version).where(s.runs.c.id == pinned.id)).scalar() == "v2"
    # and explain says which version is missing, with the versions the workers of Q have
    why = reasons(orc, pinned.id)["unregistered"]
    assert why.detail == (
        f"no live worker of code version v2 on queue {Q} has task t registered (workers on {Q}: w-v1 (version v1))"
    )
    assert why.data["code_version"] == "v2" and why.data["versions"] == {"w-v1": "v1"}
    # When a worker of v2 that lacks the task registers, it is still held, and explained so
    register(orc, "w-v2-old", "v2", ["u"])
    assert row(orc, pinned.id).state == "READY"
    assert reasons(orc, pinned.id)["unregistered"].detail == (
        f"no live worker of code version v2 on queue {Q} has task t registered"
        f" (workers on {Q}: w-v1 (version v1), w-v2-old (version v2))"
    )
    # the watchdog flags it, naming the version
    orc.reconciler.run_pass()
    view = orc.run(pinned.id).status()
    assert view.needs_attention and "no live worker of code version v2" in (view.stuck or ""), view.stuck
    # When a worker of v2 that has it registers, it goes out on Q@v2 without anyone acting
    register(orc, "w-v2", "v2", ["t", "u"])
    assert row(orc, pinned.id).state == "QUEUED"
    assert [q for run_id, q in published(orc) if run_id == pinned.id] == [f"{Q}@v2"]
    orc.reconciler.run_pass()
    assert not orc.run(pinned.id).status().needs_attention


def test_a_pinned_run_without_any_worker_of_its_queue_is_explained_too(orc: Orchestrator) -> None:
    run = orc.submit(one_task(), code_version="build.7+abc")
    assert row(orc, run.id).queue == f"{Q}@build.7+abc"
    assert reasons(orc, run.id)["unregistered"].detail == (
        f"no live worker of code version build.7+abc on queue {Q} has task t registered (workers on {Q}: none)"
    )


def test_a_code_version_is_checked_at_submit(orc: Orchestrator) -> None:
    for bad in ("", "-v1", "v 1", "x" * 65, "v1@v2", 7):
        with pytest.raises(ValidationError, match="code_version"):
            orc.submit(one_task(), code_version=bad)  # type: ignore[arg-type]
    dag = DAG("long")
    dag.task("x", "t", queue="q" * 195)
    with pytest.raises(ValidationError, match="longer than 200"):
        orc.submit(dag, code_version="v12345")
    with orc.store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(s.runs)).scalar() == 0


def test_the_workers_listing(orc: Orchestrator) -> None:
    register(orc, "b-v1", "v1", ["t", "u"])
    orc.register_worker("a-any", [Q], 3)  # says nothing of its tasks, nor of its version
    register(orc, "c-acme", "v1", ["t"], tuple(tenant_queues("acme")))
    with orc.store.engine.begin() as conn:  # a worker past the TTL is not listed
        conn.execute(
            s.workers.insert().values(
                name="gone", queues=[Q], concurrency=1, started_at=sa.func.now(),
                seen_at=sa.text("now() - interval '1 hour'"), code_version="v0",
            )
        )  # fmt: skip
    found = orc.list_workers()
    assert [(w.name, w.code_version, w.task_count, w.concurrency) for w in found] == [
        ("a-any", None, None, 3), ("b-v1", "v1", 2, 2), ("c-acme", "v1", 1, 2),
    ]  # fmt: skip
    assert found[1].queues == [Q, f"{Q}@v1"] and found[1].seen_ago < 60
    assert found[1].to_json()["tasks"] == ["t", "u"] and found[0].to_json()["tasks"] is None
    # a reader bound to another tenant sees no acme queue
    bravo = [(w.name, w.queues) for w in orc.store.reads.scoped("bravo").workers(orc.settings.worker_ttl)]
    assert bravo == [("a-any", [Q]), ("b-v1", [Q, f"{Q}@v1"])]
    acme = {w.name: w.queues for w in orc.store.reads.scoped("acme").workers(orc.settings.worker_ttl)}
    assert acme["c-acme"] == sorted([*tenant_queues("acme"), *pinned_queues(tenant_queues("acme"), "v1")])


def test_two_registrations_of_one_worker_at_once_never_collide(orc: Orchestrator) -> None:
    # a worker restarting while its old process's heartbeat re-registers it: one row, no error
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def register_often(version: str) -> None:
        try:
            for _ in range(20):
                barrier.wait(timeout=30)
                orc.store.workers.register("w", [Q, f"{Q}@{version}"], 1, ["t"], code_version=version)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=register_often, args=(v,)) for v in ("v1", "v2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    [view] = orc.list_workers()
    assert view.name == "w" and view.queues == [Q, f"{Q}@{view.code_version}"] and view.tasks == ["t"]
