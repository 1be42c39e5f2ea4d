"""``orchestrator explain``: every reason kind, from a real store (SQLite) and the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import DAG, Orchestrator, Settings
from orchestrator.publisher import RecordingPublisher
from orchestrator.registry import StaticRegistry

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def orc(tmp_path: Path, pg_clean: str) -> Iterator[Orchestrator]:
    settings = Settings.from_env(
        {}, data_dir=str(tmp_path), database_url=pg_clean, poison_threshold=2, dispatch_depth=1
    )
    o = Orchestrator(settings, publisher=RecordingPublisher(), registry=StaticRegistry(["t.ok", "t.bad"]))
    yield o
    o.store.dispose()


def kinds(orc: Orchestrator, run_id: str) -> dict[str, list[str]]:
    return {e.key: [r.kind for r in e.reasons] for e in orc.explain(run_id)}


def take(orc: Orchestrator) -> list:  # type: ignore[type-arg]
    pub = orc.publisher
    assert isinstance(pub, RecordingPublisher)
    return pub.take()


def test_each_reason_kind(orc: Orchestrator, tmp_path: Path) -> None:
    dag = DAG("why")
    a = dag.task("a", "t.ok")
    b = dag.task("b", "t.bad", max_attempts=3, backoff={"base": 600, "cap": 600, "jitter": "none"})
    dag.task("c", "t.ok", upstream=[a, b])
    dag.task("d", "t.ok", queue="nobody.listens")
    run = orc.submit(dag)
    # no worker at all yet: every READY root says so
    assert kinds(orc, run.id) == {
        "a": ["no_worker"],
        "b": ["no_worker"],
        "c": ["waiting_on_parents", "trigger_rule"],
        "d": ["no_worker"],
    }
    orc.register_worker("w", ["orchestrator.default"], 1)  # window 1 (depth 1): admits one of a, b
    sent = take(orc)
    assert len(sent) == 1
    first = sent[0].key
    other = "b" if first == "a" else "a"
    found = {e.key: e for e in orc.explain(run.id)}
    assert [r.kind for r in found[first].reasons] == ["queued"]
    assert [r.kind for r in found[other].reasons] == ["window_full"]
    assert found["d"].reasons[0].detail.startswith("no live worker consumes nobody.listens")
    # run b into its backoff: RETRYING until not_before
    orc.register_worker("w2", ["orchestrator.default"], 5)
    for d in take(orc) + sent:
        assert orc.claim(d.token, "w2:1", d.task_name) is not None
        if d.key == "b":
            orc.fail_attempt(d.token, error="boom", exc_types=["ValueError"], fingerprint="f1")
        else:
            assert orc.complete(d.token, None).accepted
    found = {e.key: e for e in orc.explain(run.id)}
    assert [r.kind for r in found["b"].reasons] == ["retry_at"] and found["b"].reasons[0].data["attempt"] == 2
    assert [r.kind for r in found["a"].reasons] == ["finished"]
    c_reasons = found["c"].reasons
    assert [r.kind for r in c_reasons] == ["waiting_on_parents", "trigger_rule"]
    assert c_reasons[0].data["parents"] == {"b": "RETRYING"}
    assert c_reasons[1].data == {
        "rule": "all_success",
        "total": 2,
        "done": 1,
        "succeeded": 1,
        "failed": 0,
        "skipped": 0,
    }
    # the JSON form, through the CLI, as a user sees it
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCHESTRATOR_")}
    env["ORCHESTRATOR_DATABASE_URL"] = orc.settings.database_url
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "explain", run.id, "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = {t["key"]: t for t in json.loads(done.stdout)["tasks"]}
    assert set(shown) == {"b", "c", "d"}  # a finished: not listed without --all
    assert shown["b"]["reasons"][0]["kind"] == "retry_at" and shown["b"]["state"] == "RETRYING"
    # cancel: every open task says why
    orc.cancel(run.id)
    assert {k: v for k, v in kinds(orc, run.id).items() if k != "a"} == {
        "b": ["finished"],
        "c": ["finished"],
        "d": ["finished"],
    }


def test_ready_behind_and_dead_letter_parents(orc: Orchestrator) -> None:
    orc.register_worker("w", ["orchestrator.default", "orchestrator.high", "orchestrator.low"], 1)
    busy = DAG("busy")
    busy.task("x", "t.ok")
    orc.submit(busy)  # takes the only slot
    backlog = DAG("backlog", priority="high")
    for i in range(3):
        backlog.task(f"h{i}", "t.ok")
    orc.submit(backlog)
    late = DAG("late")
    bad = late.task("bad", "t.bad", max_attempts=5, backoff={"base": 0.01, "cap": 0.01, "jitter": "none"})
    late.task("after", "t.ok", upstream=[bad])
    low = DAG("low", priority="low")
    low.task("l", "t.ok")
    low_run = orc.submit(low)
    found = {e.key: e for e in orc.explain(low_run.id)}
    # the three high tasks go first (another queue, same workers), and every slot is taken
    assert [r.kind for r in found["l"].reasons] == ["ready_behind", "window_full"]
    assert found["l"].reasons[0].data["ahead"] == 3
    late_run = orc.submit(late)
    # park "bad" in DEAD_LETTER: the same fingerprint twice
    orc.register_worker("w2", ["orchestrator.default"], 10)
    for attempt in (1, 2):
        for d in take(orc):
            if d.key != "bad":
                continue
            assert orc.claim(d.token, "w2:1", d.task_name) is not None
            orc.fail_attempt(d.token, error="same", exc_types=["ValueError"], fingerprint="same")
        orc.reconcile()
        if attempt == 1:
            import time

            time.sleep(0.05)
            orc.reconcile()
    found = {e.key: e for e in orc.explain(late_run.id)}
    assert [r.kind for r in found["bad"].reasons] == ["dead_letter"]
    assert [r.kind for r in found["after"].reasons] == ["waiting_on_parents", "parent_dead_letter", "trigger_rule"]


def test_explaining_some_keys_reads_only_them_and_says_the_same(orc: Orchestrator) -> None:
    """The run page explains the waiting tasks of one page only (`keys=`): the same reasons as
    for the whole run, from the named tasks and their parents alone."""
    dag = DAG("some")
    a = dag.task("a", "t.ok")
    b = dag.task("b", "t.bad")
    dag.task("c", "t.ok", upstream=[a, b])
    dag.task("d", "t.ok", upstream=["c"])
    dag.task("e", "t.ok", queue="nobody.listens")
    run = orc.submit(dag)
    whole = {e.key: [r.to_json() for r in e.reasons] for e in orc.explain(run.id)}
    some = {e.key: [r.to_json() for r in e.reasons] for e in orc.explain(run.id, keys={"c", "e"})}
    assert some == {"c": whole["c"], "e": whole["e"]}
    data = orc.reads.explain_input(run.id, worker_ttl=30, depth=1, keys={"d"})
    assert sorted(t.key for t in data.tasks) == ["c", "d"] and data.edges == [("c", "d")]
