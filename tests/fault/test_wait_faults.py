"""Waits under faults: a worker killed right after a body deferred (a crash point fires in the
pool process between the RUNNING -> WAITING commit and the message's ack), a whole worker killed
while a body is about to defer, and a private Postgres restarted while 1,000 tasks wait (wait
nodes and deferred bodies) before their events are emitted.

Each scenario ends with every task SUCCEEDED exactly once (one accepted outcome per attempt, one
accepted result per task), the database's invariants (``check_runs``), an empty broker and
``orchestrator verify`` passing.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from orchestrator.store import schema as s
from tests.fault.harness import ROOT, Cluster, P, accepted, rejected
from tests.fault.pg import PrivatePostgres

pytestmark = pytest.mark.fault
T = TaskState
FAST_BACKOFF = {"base": 0.2, "cap": 0.5}
#: the transitions that end an attempt (a deferral ends it too: the resumed body is the next one)
OUTCOMES = ("SUCCEEDED", "FAILED", "RETRYING", "WAITING", "DEAD_LETTER", "UPSTREAM_FAILED", "SKIPPED")


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    try:
        pg.init()
        pg.start()
        yield pg
    finally:
        pg.close()


def outcomes_by_attempt(cluster: Cluster, run_id: str, key: str) -> dict[int, list[str]]:
    """The accepted transitions out of RUNNING (or out of a wait) of ``key``, per attempt."""
    found: dict[int, list[str]] = defaultdict(list)
    for e in accepted(cluster.events(run_id)):
        if e.key == key and e.to_state in OUTCOMES and e.from_state in ("RUNNING", "QUEUED"):
            found[e.attempt].append(e.to_state)
    return dict(found)


def verified(cluster: Cluster, *run_ids: str) -> None:
    """``check_runs`` and an empty broker, then ``orchestrator verify`` on the runs."""
    cluster.assert_clean(run_ids)
    done = cluster.cli("verify", *run_ids)
    print(f"$ orchestrator verify {' '.join(run_ids)}\n{done.stdout}{done.stderr}", end="")
    assert done.returncode == 0 and "no violation" in done.stdout, done.stdout + done.stderr


def deferring_dag(name: str, event: str, *, seconds: float = 0.0) -> DAG:
    """job (defers until ``event`` {"id": 7}, saving {"cursor": 3}) -> after (its result)."""
    dag = DAG(name)
    kwargs = {"event": event, "match": {"id": 7}, "state": {"cursor": 3}, "seconds": seconds}
    job = dag.task("job", P + "deferring", kwargs=kwargs, max_attempts=3, backoff=FAST_BACKOFF)
    dag.task("after", P + "echo", upstream=[job], max_attempts=3, backoff=FAST_BACKOFF)
    return dag


def resumed_once(cluster: Cluster, run_id: str, final_attempt: int) -> None:
    """job SUCCEEDED once, on ``final_attempt``, with the event and its saved state; after got it."""
    tasks = {t.key: t for t in cluster.store.reads.get_tasks(run_id)}
    job = tasks["job"]
    assert job.state is T.SUCCEEDED and job.attempt == final_attempt, (job.state, job.attempt)
    assert job.result["resumed"]["event"] == {"id": 7, "url": "s3://x"}
    assert job.result["resumed"]["state"] == {"cursor": 3}
    assert job.result["attempt"] == final_attempt
    assert tasks["after"].state is T.SUCCEEDED and tasks["after"].result["upstream"] == {"job": job.result}
    ok = [e.attempt for e in accepted(cluster.events(run_id), dst="SUCCEEDED") if e.key == "job"]
    assert ok == [final_attempt], ok


def test_pool_process_killed_right_after_the_defer_commit(cluster: Cluster, tmp_path: Path) -> None:
    # Given one slot, one message in flight per slot, and w1 armed to die at its first publish
    # after a commit: the one a deferral makes when it hands its freed slot to READY work
    cluster.configure(ORCHESTRATOR_DISPATCH_DEPTH="1")
    marker = tmp_path / "crashed-once"
    crash = {"ORCHESTRATOR_CRASH_AT": "after_dispatch_commit", "ORCHESTRATOR_CRASH_MARKER": str(marker)}
    w1 = cluster.worker("w1", concurrency=1, env=crash)
    run = cluster.orc.submit(deferring_dag("defer-then-crash", "export.done", seconds=2.0))
    cluster.wait_for(lambda: cluster.effects(run.id)[("job", 1)] == 1, 30, "job's body started", run_id=run.id)
    # a neighbour's task waits READY for the one slot job holds
    neighbour = DAG("neighbour")
    neighbour.task("x", P + "noop", max_attempts=3, backoff=FAST_BACKOFF)
    other = cluster.orc.submit(neighbour)
    assert cluster.store.reads.get_task(other.id, "x").state is T.READY

    # When job's body raises Defer: RUNNING -> WAITING commits (x admitted in the same
    # transaction) and the pool process dies before publishing x and before acking job's message
    cluster.wait_for(marker.exists, 30, "the crash right after the defer commit", run_id=run.id)
    job = cluster.wait_task(run.id, "job", lambda t: t.state is T.WAITING, 10, "job waiting")
    assert (job.attempt, job.worker) == (1, None)
    assert cluster.store.reads.get_task(other.id, "x").state is T.QUEUED  # admitted, never published
    # then the whole worker dies, and the event comes while no worker lives
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    assert cluster.orc.events.emit("export.done", {"id": 7, "url": "s3://x"}).woken == 1
    redelivered = cluster.restore_unacked()  # what kombu does once the visibility timeout passed
    cluster.worker("w2", concurrency=2)
    cluster.reconciler()

    # Then job is resumed once (attempt 2) with the event and its state; x runs once
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    assert cluster.wait_run(other.id, 60) is RunState.SUCCEEDED
    resumed_once(cluster, run.id, 2)
    assert outcomes_by_attempt(cluster, run.id, "job") == {1: ["WAITING"], 2: ["SUCCEEDED"]}
    effects = cluster.effects(run.id)
    assert effects[("job", 1)] == 1 and effects[("job", 2)] == 1, effects
    assert cluster.effects(other.id)[("x", 1)] == 1
    stale = [e for e in rejected(cluster.events(run.id), dst="RUNNING") if e.key == "job" and e.attempt == 1]
    print(f"\nunacked messages restored: {redelivered}; job's attempt-1 redeliveries refused: {len(stale)}")
    verified(cluster, run.id, other.id)


def test_worker_killed_while_its_body_is_about_to_defer(cluster: Cluster) -> None:
    # Given job's first attempt on w1 (one slot), in the sleep before it defers
    w1 = cluster.worker("w1", concurrency=1)
    cluster.reconciler()
    run = cluster.orc.submit(deferring_dag("kill-before-defer", "export.done", seconds=30.0))
    cluster.wait_for(lambda: cluster.effects(run.id)[("job", 1)] == 1, 30, "job's body started", run_id=run.id)
    # (claimed: a direct message's body is claimed once its claim delay is up)
    cluster.wait_task(run.id, "job", lambda t: t.state is T.RUNNING, 10, "job claimed")

    # When w1 (main process and pool) is SIGKILLed and another worker starts
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    cluster.restore_unacked()
    cluster.worker("w2", concurrency=2)

    # Then the lost attempt is retried after its lease; attempt 2 defers; the event resumes it
    job = cluster.wait_task(run.id, "job", lambda t: t.state is T.WAITING, 30, "job deferred by attempt 2")
    assert job.attempt == 2
    assert cluster.orc.events.emit("export.done", {"id": 7, "url": "s3://x"}).woken == 1
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    resumed_once(cluster, run.id, 3)
    by_attempt = outcomes_by_attempt(cluster, run.id, "job")
    assert by_attempt == {1: ["RETRYING"], 2: ["WAITING"], 3: ["SUCCEEDED"]}, by_attempt
    effects = cluster.effects(run.id)
    assert effects[("job", 1)] == 1 and effects[("job", 2)] == 1 and effects[("job", 3)] == 1, effects
    verified(cluster, run.id)


RUNS, WAITS, DEFERS, GROUPS = 10, 80, 20, 10


def waiting_dag(r: int) -> DAG:
    """80 wait nodes (event ``wf``, match run and group) and 20 bodies deferring (event ``wfd``),
    each of ten groups woken by one event; ``end`` below all of them."""
    dag = DAG(f"waiting-{r}")
    keys = []
    for j in range(WAITS):
        keys.append(dag.wait(f"w{j:02d}", event="wf", match={"run": r, "group": j % GROUPS}).key)
    for j in range(DEFERS):
        kwargs = {"event": "wfd", "match": {"run": r, "group": j % GROUPS}, "state": {"j": j}}
        keys.append(dag.task(f"d{j:02d}", P + "deferring", kwargs=kwargs, max_attempts=3, backoff=FAST_BACKOFF).key)
    dag.task("end", P + "noop", upstream=keys, max_attempts=3, backoff=FAST_BACKOFF)
    return dag


def count_waiting(cluster: Cluster, run_ids: list[str]) -> int:
    with cluster.store.engine.connect() as conn:
        query = sa.select(sa.func.count()).where(s.tasks.c.run_id.in_(run_ids), s.tasks.c.state == "WAITING")
        return int(conn.execute(query).scalar_one())


def emit_retrying(cluster: Cluster, key: str, payload: dict[str, Any], event_id: str) -> int:
    """An emit that rides out a dropped connection (its event id makes a repeat a duplicate)."""
    for _ in range(20):
        try:
            return cluster.orc.events.emit(key, payload, event_id=event_id).woken
        except sa.exc.OperationalError:
            time.sleep(0.5)
    pytest.fail(f"emit {key} {payload} never went through")


def test_postgres_restarted_while_a_thousand_tasks_wait(cluster: Cluster, private_pg: PrivatePostgres) -> None:
    cluster.configure(ORCHESTRATOR_DATABASE_URL=private_pg.url, ORCHESTRATOR_LEASE_SECONDS="15",
                      ORCHESTRATOR_RECORD_PROBE_EFFECTS="0")  # fmt: skip
    migrated = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "db", "upgrade"],
        cwd=ROOT,
        env=cluster.env(),
        capture_output=True,
    )
    assert migrated.returncode == 0, migrated.stderr
    started = time.monotonic()
    w1 = cluster.worker("w1", concurrency=4)
    reconciler = cluster.reconciler()

    # Given ten runs whose 1,000 tasks wait: 800 wait nodes, 200 bodies that deferred
    run_ids = [cluster.orc.submit(waiting_dag(r)).id for r in range(RUNS)]
    total = RUNS * (WAITS + DEFERS)
    cluster.wait_for(lambda: count_waiting(cluster, run_ids) == total, 90, f"{total} tasks waiting")
    all_waiting = time.monotonic() - started

    # When the server is restarted (every session ended, the port refused for 3 s)
    private_pg.restart(down_for=3.0)
    cluster.store.engine.dispose()  # this process's connections died with the server
    time.sleep(2.0)  # the worker's and the reconciler's passes meet the new server
    # Then every task still waits: nothing lost, nothing woken, nothing timed out
    assert count_waiting(cluster, run_ids) == total
    assert w1.popen.poll() is None and reconciler.popen.poll() is None, cluster.tails()

    # When the events come: one per run, group and kind (each wakes 8 waits or 2 deferred bodies)
    emitting = time.monotonic()
    woken = 0
    for r in range(RUNS):
        for g in range(GROUPS):
            woken += emit_retrying(cluster, "wf", {"run": r, "group": g, "ok": True}, f"wf-{r}-{g}")
            woken += emit_retrying(cluster, "wfd", {"run": r, "group": g}, f"wfd-{r}-{g}")
    assert woken == total

    # Then every run SUCCEEDS, each task once, the deferred bodies with their own event and state
    for run_id in run_ids:
        assert cluster.wait_run(run_id, 90) is RunState.SUCCEEDED
    finished = time.monotonic() - emitting
    for r, run_id in enumerate(run_ids):
        tasks = {t.key: t for t in cluster.store.reads.get_tasks(run_id)}
        assert {t.state for t in tasks.values()} == {T.SUCCEEDED}
        for j in range(WAITS):
            assert tasks[f"w{j:02d}"].result == {"run": r, "group": j % GROUPS, "ok": True}
        for j in range(DEFERS):
            d = tasks[f"d{j:02d}"]
            assert d.result["resumed"]["event"] == {"run": r, "group": j % GROUPS}
            assert d.result["resumed"]["state"] == {"j": j} and d.attempt == d.result["attempt"] == 2
        ok = [(e.key, e.attempt) for e in accepted(cluster.events(run_id), dst="SUCCEEDED")]
        assert len(ok) == len(set(k for k, _ in ok)) == WAITS + DEFERS + 1, len(ok)
    verified(cluster, *run_ids)
    print(f"\n{total} waiting after {all_waiting:.1f}s; all {RUNS} runs final {finished:.1f}s after the first"
          f" emit; the scenario took {time.monotonic() - started:.1f}s")  # fmt: skip


# ---------------------------------------------------------------- event triggers, doubled


TRIGGER_TOKEN = "trigger-fault-token-0123456789"


def test_two_beats_and_two_serves_start_one_run_per_trigger_and_event(cluster: Cluster, tmp_path: Path) -> None:
    """An event trigger with everything doubled: two ``orchestrator beat`` (each finishing open
    firings on its pass), two ``orchestrator serve`` taking ``POST /api/events``, every event
    posted to both at once (the same event id), and one serve killed with -9 half-way. From the
    database: one run per (trigger, event), every firing fired, no event stored twice."""
    import json as jsonlib
    import threading
    import urllib.request

    from tests.fault.test_beat import beat
    from tests.integration.conftest import serving

    spec = tmp_path / "on-order.yaml"
    spec.write_text("name: on-order\nnodes:\n  - {key: only, task: tasks.probes.noop, kwargs: {}}\n")
    out = cluster.cli("on", "add", "orders", "--event", "order.new", "--spec", str(spec))
    assert out.returncode == 0, out.stderr + out.stdout
    beats = [beat(cluster, "beat-a"), beat(cluster, "beat-b")]
    env = cluster.env(ORCHESTRATOR_UI_AUTH=TRIGGER_TOKEN)
    n = 40
    failures: list[str] = []

    def post(base: str, i: int) -> None:
        body = jsonlib.dumps({"key": "order.new", "payload": {"order": i}, "event_id": f"order-{i}"}).encode()
        request = urllib.request.Request(
            base + "/api/events", data=body, method="POST",
            headers={"Authorization": f"Bearer {TRIGGER_TOKEN}", "Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                if r.status != 200:
                    failures.append(f"{base} {i}: {r.status}")
        except OSError as exc:  # the serve killed below: its half of the pair may fail, the other's counts
            failures.append(f"{base} {i}: {exc}")

    try:
        with serving(tmp_path / "serve-a.log", env) as (_, base_a), serving(tmp_path / "serve-b.log", env) as (
            proc_b, base_b,
        ):  # fmt: skip
            for i in range(n):
                pair = [threading.Thread(target=post, args=(b, i)) for b in (base_a, base_b)]
                for th in pair:
                    th.start()
                for th in pair:
                    th.join(60)
                if i == n // 2:
                    proc_b.send_signal(signal.SIGKILL)  # serve B dies: A (and the beats) carry on
                    proc_b.wait(10)
                    base_b = base_a
        cluster.worker("trigger-worker")

        def all_ran() -> bool:
            with cluster.store.engine.connect() as conn:
                done = conn.execute(
                    sa.select(sa.func.count())
                    .select_from(s.runs)
                    .where(s.runs.c.trigger == "orders", s.runs.c.state == "SUCCEEDED")
                ).scalar_one()
            return bool(done >= n)

        cluster.wait_for(all_ran, 120, "every triggered run to finish")
        with cluster.store.engine.connect() as conn:
            runs = conn.execute(
                sa.select(s.runs.c.idempotency_key, s.runs.c.params).where(s.runs.c.trigger == "orders")
            ).all()
            firings = conn.execute(sa.select(s.trigger_firings.c.state, s.trigger_firings.c.run_id)).all()
            events = conn.execute(sa.select(s.emitted.c.event_id)).scalars().all()
        assert len(runs) == n and len({r.idempotency_key for r in runs}) == n
        assert sorted(r.params["order"] for r in runs) == list(range(n))
        assert len(events) == n == len(set(events))  # each event stored once, whatever posted it twice
        assert [f.state for f in firings] == ["fired"] * n and len({f.run_id for f in firings}) == n
        assert not [f for f in failures if base_a in f], failures
        verify = cluster.cli("verify", *[f.run_id for f in firings])
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        for b in beats:
            b.stop()
