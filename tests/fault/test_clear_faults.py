"""Clear under faults: the worker running the cleared attempt SIGKILLed just before the clear and
just after it, and a running attempt cleared while its worker lives (the body interrupted,
and a body that will not stop has its late result refused and recorded).

Each scenario ends with the task SUCCEEDED exactly once in its newest generation (the attempt
the clear made, or a later one), no outcome of the old attempt accepted, the database's
invariants (``check_runs``) and ``orchestrator verify`` passing.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, RunState, TaskState
from tests.fault.harness import Cluster, Proc, accepted, rejected, worker_pid

pytestmark = pytest.mark.fault
T = TaskState
D = "tasks.dynamic."
FAST_BACKOFF = {"base": 0.2, "cap": 0.5}
OUTCOMES = ("SUCCEEDED", "FAILED", "RETRYING", "UPSTREAM_FAILED", "SKIPPED")


def slow_then_fast(name: str, seconds: float = 30.0, *, task: str = "gated") -> DAG:
    """a (its first attempt sleeps ``seconds``, later ones return at once) -> b (a's result)."""
    dag = DAG(name)
    kwargs: dict[str, Any] = {"first_seconds": seconds} if task == "gated" else {"seconds": seconds}
    a = dag.task("a", D + task, kwargs=kwargs, max_attempts=3, backoff=FAST_BACKOFF)
    dag.task("b", D + "collect", upstream=[a], max_attempts=3, backoff=FAST_BACKOFF)
    return dag


def running_on(cluster: Cluster, run_id: str, w: Proc) -> Any:
    """Until a's attempt 1 is RUNNING with its body started; assert it runs on ``w``."""
    a = cluster.wait_task(run_id, "a", lambda t: t.state is T.RUNNING, 60, "a running")
    assert a.attempt == 1 and os.getpgid(worker_pid(a)) == w.pid
    cluster.wait_for(lambda: cluster.effects(run_id)[("a", 1)] == 1, 60, "a's body started", run_id=run_id)
    return a


def clear_cli(cluster: Cluster, run_id: str, *args: str) -> str:
    done = cluster.cli("clear", run_id, *args)
    print(f"\n$ orchestrator clear {run_id} {' '.join(args)}\n{done.stdout}{done.stderr}", end="")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def succeeded_once_in_newest_generation(cluster: Cluster, run_id: str) -> tuple[int, Any]:
    """a and b SUCCEEDED; a was cleared once; a's one accepted result is of the row's attempt
    (the clear's, or later), b got it; no outcome of a's attempts before the clear was accepted.
    Returns a's final attempt and the clear's ledger row."""
    events = cluster.events(run_id)
    clears = [e for e in accepted(events, dst="PENDING", actor="operator") if e.key == "a"]
    assert len(clears) == 1, clears
    cleared_at = clears[0].attempt
    tasks = {t.key: t for t in cluster.store.reads.get_tasks(run_id)}
    a = tasks["a"]
    assert a.state is T.SUCCEEDED and tasks["b"].state is T.SUCCEEDED
    ok = [e.attempt for e in accepted(events, dst="SUCCEEDED") if e.key == "a"]
    assert ok == [a.attempt] and a.attempt >= cleared_at, (ok, a.attempt)
    assert a.result["attempt"] == a.attempt
    assert tasks["b"].result == {"a": a.result}
    old = [e for e in accepted(events) if e.key == "a" and e.attempt < cleared_at and e.to_state in OUTCOMES]
    assert old == [], [(e.attempt, e.from_state, e.to_state, e.actor) for e in old]
    return int(a.attempt), clears[0]


def verified(cluster: Cluster, run_id: str) -> None:
    """``check_runs`` (and an empty broker), then ``orchestrator verify`` on the run."""
    cluster.assert_clean([run_id])
    done = cluster.cli("verify", run_id)
    print(f"$ orchestrator verify {run_id}\n{done.stdout}{done.stderr}", end="")
    assert done.returncode == 0 and "no violation" in done.stdout, done.stdout + done.stderr


def stale_claim_refused(cluster: Cluster, run_id: str) -> bool:
    """Redeliver what the killed worker had taken (as kombu does after its visibility timeout):
    the old attempt's message is refused at claim, recorded. Returns whether there was one (a
    revoke that reached the worker before it died had it acknowledged).

    Every message of a that the dead worker held is restored (attempt 1's, and attempt 2's
    when it had taken that one too before it died: the reconciler re-published it to w2), never
    w2's: it may still hold b's delivery unacknowledged (its ack follows b's commit); restoring
    everything then, on a loaded machine, left a's refusal to wait for."""
    first = cluster.unacked(run_id, "a", 1)
    cluster.restore_unacked(run_id, "a")
    if not first and not [
        e for e in rejected(cluster.events(run_id), dst="RUNNING") if e.key == "a" and e.attempt == 1
    ]:
        return False
    cluster.wait_for(
        lambda: [e for e in rejected(cluster.events(run_id), dst="RUNNING") if e.key == "a" and e.attempt == 1],
        60,
        "a's attempt-1 redelivery to be refused",
        run_id=run_id,
    )
    return True


def test_worker_killed_then_its_running_task_cleared(cluster: Cluster) -> None:
    # Given a's first attempt sleeping on w1 (one slot, so nothing else is prefetched), leases
    # long enough that a is still RUNNING, its worker dead, when the clear comes (60 s: on a
    # loaded machine the clear's command line took longer than a 10 s lease to start)
    cluster.configure(ORCHESTRATOR_LEASE_SECONDS="60", ORCHESTRATOR_WORKER_TTL="20")
    w1 = cluster.worker("w1", concurrency=1)
    cluster.reconciler()
    run = cluster.orc.submit(slow_then_fast("kill-then-clear"))
    running_on(cluster, run.id, w1)

    # When w1 (main process and pool) is SIGKILLed, then an operator clears a
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    out = clear_cli(cluster, run.id, "a")
    assert out == f"{run.id}: cleared 1 task(s): a"
    cluster.worker("w2", concurrency=2)

    # Then a's attempt 2 runs at once (no lease to wait out) and the run succeeds
    assert cluster.wait_run(run.id, 30) is RunState.SUCCEEDED
    final, clear = succeeded_once_in_newest_generation(cluster, run.id)
    # the lease (60 s) had not expired: the clear fenced the dead worker's RUNNING attempt
    assert (clear.attempt, clear.from_state, final) == (2, "RUNNING", 2)
    effects = cluster.effects(run.id)
    assert effects[("a", 1)] == 1 and effects[("a", 2)] == 1
    assert stale_claim_refused(cluster, run.id)
    verified(cluster, run.id)


def test_running_task_cleared_then_its_worker_killed(cluster: Cluster) -> None:
    # Given a's first attempt sleeping on w1 (one slot)
    w1 = cluster.worker("w1", concurrency=1)
    cluster.reconciler()
    run = cluster.orc.submit(slow_then_fast("clear-then-kill"))
    running_on(cluster, run.id, w1)

    # When an operator clears a (through the API: the kill follows the commit within a few
    # milliseconds) and w1 is SIGKILLed right after
    assert cluster.orc.clear(run.id, "a", by="fault-test") == ["a"]
    w1.signal_group(signal.SIGKILL)
    w1.popen.wait(10)
    cluster.worker("w2", concurrency=2)

    # Then a succeeds once, on the attempt the clear made (or, had w1 taken that one before it
    # died, on the retry after its lease), never on attempt 1
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    final, clear = succeeded_once_in_newest_generation(cluster, run.id)
    assert (clear.attempt, clear.from_state) == (2, "RUNNING")
    # the attempt-1 message is refused when redelivered, unless the revoke reached w1 first
    # (it then ended the body and acknowledged the message)
    redelivered = stale_claim_refused(cluster, run.id)
    verified(cluster, run.id)
    revoked = "Terminating" in w1.text()
    print(f"clear then kill: a succeeded on attempt {final}; revoke reached w1 first: {revoked};"
          f" attempt-1 message redelivered and refused: {redelivered}")  # fmt: skip


def test_clearing_a_running_task_interrupts_its_body(cluster: Cluster) -> None:
    # Given a's first attempt sleeping 30 s on a live worker
    w1 = cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(slow_then_fast("clear-running"))
    a = running_on(cluster, run.id, w1)
    pid = worker_pid(a)

    # When an operator clears it
    started = time.monotonic()
    assert clear_cli(cluster, run.id, "a") == f"{run.id}: cleared 1 task(s): a"

    # Then attempt 1's body is stopped well before its sleep ends: its pool process is ended by
    # the revoke, or its heartbeat fails and the body is interrupted with LeaseLost (that outcome
    # refused and recorded)
    def stopped() -> str:
        lost = [e for e in rejected(cluster.events(run.id)) if e.key == "a" and e.attempt == 1]
        if lost:
            return "fenced: " + "; ".join(f"{e.from_state} -> {e.to_state} refused: {e.reason}" for e in lost)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"pool process {pid} ended by the revoke"
        return ""

    # (stopped, not ended: a fenced body raised LeaseLost, or its process is gone; a body that ran
    # its 30 s to the end would instead report a result of attempt 1, refused as stale: checked
    # below from the ledger, not by how soon a loaded machine got there)
    how = cluster.wait_for(stopped, 25, "attempt 1's body to be stopped", run_id=run.id)
    took = time.monotonic() - started
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    assert succeeded_once_in_newest_generation(cluster, run.id)[0] == 2
    # and the refused outcome says it was fenced: a body terminated by the revoke (SIGTERM, a
    # SystemExit in the pool process) is no failure of the task's code, never to be retried
    refused = [e.reason or "" for e in rejected(cluster.events(run.id))
               if e.key == "a" and e.attempt == 1 and e.to_state in ("RETRYING", "FAILED", "DEAD_LETTER")]  # fmt: skip
    assert all(r.startswith("LeaseLost: ") and "SystemExit" not in r for r in refused), refused
    assert all("body terminated (SIGTERM)" in r for r in refused if "terminated" in r), refused
    verified(cluster, run.id)
    ended = [e for e in cluster.events(run.id) if e.key == "a" and e.attempt == 1 and e.to_state == "SUCCEEDED"]
    assert ended == [], "attempt 1's body ran to its end"
    print(f"attempt 1 stopped {took:.1f} s after the clear began: {how}")


def test_a_body_that_will_not_stop_has_its_late_result_refused(cluster: Cluster) -> None:
    # Given a's first attempt in a body that ignores SIGTERM and swallows LeaseLost (10 s: on a
    # loaded machine a 4 s body ended before the clear's command line had started)
    w1 = cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(slow_then_fast("late-result", 10.0, task="stubborn"))
    running_on(cluster, run.id, w1)

    # When an operator clears it while it runs (through the API: at once)
    assert cluster.orc.clear(run.id, "a", by="fault-test") == ["a"]
    (clear,) = [e for e in accepted(cluster.events(run.id), dst="PENDING", actor="operator") if e.key == "a"]
    assert clear.from_state == "RUNNING", clear.from_state

    # Then the old attempt's late result is refused and recorded in the ledger, and a's attempt
    # 2 is the one accepted
    late = cluster.wait_for(
        lambda: [e for e in rejected(cluster.events(run.id), dst="SUCCEEDED") if e.key == "a" and e.attempt == 1],
        20,
        "attempt 1's late result to be refused",
        run_id=run.id,
    )
    assert len(late) == 1 and "row holds" in (late[0].reason or ""), late[0].reason
    assert cluster.wait_run(run.id, 30) is RunState.SUCCEEDED
    assert succeeded_once_in_newest_generation(cluster, run.id)[0] == 2
    assert cluster.store.reads.get_task(run.id, "a").result == {"attempt": 2, "interrupted": 0}
    assert cluster.effects(run.id)[("a", 1)] == 1
    # the heartbeat noticed, the body swallowed it
    assert "lease lost for" in w1.text()
    verified(cluster, run.id)
    print(f"late result refused: {late[0].from_state} -> {late[0].to_state}: {late[0].reason}")


def test_clearing_a_direct_body_before_its_claim(cluster: Cluster) -> None:
    # Given a's first attempt, a direct message, sleeping in its body before its claim (a claim
    # delay longer than the sleep: the row stays QUEUED while the body runs)
    # (60 s, cleared through the API at once: on a loaded machine a 20 s body ended, and claimed,
    # before the clear's command line had started)
    cluster.configure(ORCHESTRATOR_CLAIM_DELAY="120")
    cluster.worker("w1", concurrency=2)
    cluster.reconciler()
    run = cluster.orc.submit(slow_then_fast("clear-unclaimed", 60.0))
    cluster.wait_for(lambda: cluster.effects(run.id)[("a", 1)] == 1, 30, "a's body started", run_id=run.id)
    assert cluster.store.reads.get_task(run.id, "a").state is T.QUEUED

    # When an operator clears it
    started = time.monotonic()
    assert cluster.orc.clear(run.id, "a", by="fault-test") == ["a"]

    # Then the revoke stops attempt 1's body, its late claim is refused and recorded, attempt 2
    # runs and the run succeeds, with a's result committed once
    assert cluster.wait_run(run.id, 60) is RunState.SUCCEEDED
    final, clear = succeeded_once_in_newest_generation(cluster, run.id)
    assert (final, clear.from_state) == (2, "QUEUED")
    refused = cluster.wait_for(
        lambda: [e for e in rejected(cluster.events(run.id), dst="RUNNING") if e.key == "a" and e.attempt == 1],
        60,
        "attempt 1's claim refused",
        run_id=run.id,
    )
    # refused when the revoke stopped the body, not when its 60 s sleep would have ended (by the
    # database's clock: from the body's start, as the probe recorded it, to the refusal)
    with cluster.store.engine.connect() as conn:
        began = conn.execute(
            sa.text("SELECT min(at) FROM orc_probe_effects WHERE run_id = :r AND key = 'a' AND attempt = 1"),
            {"r": run.id},
        ).scalar_one()
    ran = (refused[0].at - began).total_seconds()
    took = time.monotonic() - started
    print(f"attempt 1's body stopped and its claim refused {ran:.1f} s after it began ({took:.1f} s after the clear)")
    assert ran < 60, ran
    verified(cluster, run.id)
