"""Poison: the same failure on consecutive attempts, a task that kills its process every time,
and a transient fault that must retry to success; dead letters raise the webhook alert."""

from __future__ import annotations

import pytest

from orchestrator import DAG, RunState, TaskState
from tests.fault.harness import Cluster, P, accepted, webhook

pytestmark = pytest.mark.fault
T = TaskState
FAST_BACKOFF = {"base": 0.2, "cap": 0.5}


def test_poison_dead_letters_and_alerts_transient_faults_retry(cluster: Cluster) -> None:
    with webhook() as hook:
        # Given workers and a reconciler that POST dead-letter alerts to a local webhook
        cluster.configure(ORCHESTRATOR_ALERT_WEBHOOK=hook.url)
        w1, w2 = cluster.start_worker("w1", concurrency=2), cluster.start_worker("w2", concurrency=2)
        cluster.wait_ready(w1, w2)
        cluster.reconciler()

        # When a task fails the same way every time, another kills its process every time,
        # and a third fails 3 times with alternating exception types (all with 5 attempts)
        poison = DAG("poison")
        poison.task("always_fails", P + "fail", kwargs={"message": "bad row 42"}, max_attempts=5, backoff=FAST_BACKOFF)
        poison.task("always_crashes", P + "crash", max_attempts=5, backoff=FAST_BACKOFF)
        bad = cluster.orc.submit(poison)
        transient = DAG("transient")
        transient.task("flaky", P + "flaky", kwargs={"fail_times": 3}, max_attempts=5, backoff=FAST_BACKOFF)
        good = cluster.orc.submit(transient)

        # Then the flaky task retried to success on attempt 4
        assert cluster.wait_run(good.id, 60) is RunState.SUCCEEDED
        flaky = cluster.store.reads.get_task(good.id, "flaky")
        assert flaky.attempt == 4 and flaky.result == 4
        retries = accepted(cluster.events(good.id), dst="RETRYING")
        assert [e.attempt for e in retries] == [1, 2, 3]
        assert ["FlakyError" in r.reason for r in retries] == [True, False, True]
        assert ["FlakyTimeout" in r.reason for r in retries] == [False, True, False]

        # And the failing task is parked in DEAD_LETTER after 2 attempts, not 5, with the
        # fingerprint evidence in its error
        fails = cluster.wait_task(
            bad.id, "always_fails", lambda t: t.state is T.DEAD_LETTER, 60, "always_fails dead-lettered"
        )
        assert fails.attempt == 2 and fails.fingerprint
        assert "ProbeFailure: bad row 42" in fails.error
        assert "[tasks.probes.ProbeFailure at probes.py:fail:" in fails.error and ": bad row #]" in fails.error
        # And the crashing task is parked as a crash loop after 2 lost leases
        crashes = cluster.wait_task(
            bad.id, "always_crashes", lambda t: t.state is T.DEAD_LETTER, 60, "always_crashes dead-lettered"
        )
        assert crashes.attempt == 2 and "crash loop" in crashes.error
        assert cluster.effects(bad.id) == {
            ("always_fails", 1): 1,
            ("always_fails", 2): 1,
            ("always_crashes", 1): 1,
            ("always_crashes", 2): 1,
        }
        events = cluster.events(bad.id)
        parked = accepted(events, src="RUNNING", dst="DEAD_LETTER")
        assert sorted((e.key, e.attempt, e.actor) for e in parked) == [
            ("always_crashes", 2, "reconciler"),
            ("always_fails", 2, "worker"),
        ]
        # the run waits for a person: not final, "needs attention"
        view = cluster.store.reads.get_run(bad.id)
        assert view.state is RunState.RUNNING and view.needs_attention

        # And one JSON alert per dead letter reached the webhook
        cluster.wait_for(lambda: len(hook.received) >= 2, 15, "two webhook alerts", run_id=bad.id)
        alerts = {a["key"]: a for a in hook.received}
        assert len(hook.received) == 2 and set(alerts) == {"always_fails", "always_crashes"}
        for key, task in (("always_fails", fails), ("always_crashes", crashes)):
            a = alerts[key]
            assert a["run_id"] == bad.id and a["attempt"] == 2 and a["error"] == task.error
            assert a["fingerprint"] == task.fingerprint
        assert alerts["always_fails"]["task"] == P + "fail" and alerts["always_crashes"]["task"] == P + "crash"

    cluster.assert_clean([good.id])
    cluster.assert_clean([bad.id], allow_dead_letter=True)
