"""``orchestrator explain``: every reason kind, from a real store (SQLite) and the engine."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, Settings, Skip
from orchestrator.core.explain import ExplainInput, explain
from orchestrator.core.publisher import RecordingPublisher
from orchestrator.core.registry import StaticRegistry
from tests.store import dynamic

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
        "upstream_failed": 0,
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


# ------------------------------------------------------------------ dynamic DAGs


@pytest.fixture
def dyn(pg_clean: str) -> Iterator[Orchestrator]:
    """An orchestrator whose workers' part ``tests.store.dynamic.drive`` plays."""
    o = dynamic.orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def why(orc: Orchestrator, run_id: str, key: str) -> dict[str, dict[str, Any]]:
    (found,) = orc.explain(run_id, key)
    return {r.kind: r.to_json() for r in found.reasons}


def test_a_skipped_task_says_why(dyn: Orchestrator) -> None:
    dag = DAG("skips")
    dag.task("pick", "t", branch=True)
    dag.task("a", "t", upstream=["pick"])
    dag.task("b", "t", upstream=["pick"])
    dag.task("b2", "t", upstream=["b"])
    dag.task("check", "t", short_circuit=True)
    dag.task("cut", "t", upstream=["check"])
    dag.task("me", "t")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x")

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "me":
            raise Skip("no new files")
        return {"pick": "a", "check": 0, "ls": []}.get(key, 1)

    d = dynamic.drive(dyn, dag, body)
    assert why(dyn, d.run_id, "b")["skipped"]["detail"] == (
        "branch_not_taken (a branch upstream followed other tasks); ledger: branch_not_taken: pick followed a"
    )
    assert why(dyn, d.run_id, "b2")["skipped"]["skip_reason"] == "upstream_skipped"
    cut = why(dyn, d.run_id, "cut")["skipped"]
    assert cut["skip_reason"] == "short_circuit" and "check returned 0" in cut["ledger_reason"]
    me = why(dyn, d.run_id, "me")["skipped"]
    assert me["skip_reason"] == "user" and me["ledger_reason"] == "user: no new files"
    assert "raised orchestrator.Skip" in me["detail"]
    assert why(dyn, d.run_id, "m")["skipped"]["skip_reason"] == "empty_map"
    # the CLI says the same
    result = cli_explain(dyn, d.run_id, "b")
    assert "  - skipped: branch_not_taken (a branch upstream" in result


def test_a_map_counts_its_children_and_a_child_names_its_map(dyn: Orchestrator) -> None:
    dag = DAG("mapped")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x")
    dag.task("join", "t", upstream=["m"], trigger_rule="all_done")

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return [10, 11, 12, 13, 14]
        if key == "m[1]":
            raise dynamic.Fail("boom")
        return 1

    d = dynamic.drive(dyn, dag, body, until=lambda d: d.states().get("m[3]") == "SUCCEEDED")
    mapped = why(dyn, d.run_id, "m")["mapped"]
    assert mapped["detail"] == "mapped into 5 task(s): 4 done (3 succeeded, 1 failed, 0 skipped)"
    child = dyn.explain(d.run_id, "m[4]")[0]
    assert child.reasons[0].kind == "map_child"
    assert child.reasons[0].detail == "item 4 (key 4) of map m" and child.reasons[0].data["index"] == 4
    join = why(dyn, d.run_id, "join")["trigger_rule"]
    assert join["total"] == 5 and join["done"] == 4 and join["failed"] == 1 and join["upstream_failed"] == 0
    d = dynamic.drive(dyn, dag, body, run_id=d.run_id)
    closed = dyn.explain(d.run_id, "m")[0]
    assert closed.state.value == "FAILED" and [r.kind for r in closed.reasons] == ["finished", "mapped"]
    assert "5 done (4 succeeded, 1 failed, 0 skipped)" in closed.reasons[1].detail
    assert "item 1 (key 1) of map m" in cli_explain(dyn, d.run_id, "m[1]")


def test_pending_counters_and_early_verdicts(dyn: Orchestrator) -> None:
    dag = DAG("counters")
    dag.task("a", "t")
    dag.task("b", "t", upstream=["a"])
    dag.task("c", "t")
    dag.task("join", "t", upstream=["a", "b", "c"], trigger_rule="all_done")
    dag.task("early", "t", upstream=["a", "c"], trigger_rule="one_failed")

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "a":
            raise dynamic.Fail("boom")
        return 1

    d = dynamic.drive(dyn, dag, body, steps=1)  # a fails, b is UPSTREAM_FAILED, c waits
    assert d.states()["b"] == "UPSTREAM_FAILED" and d.states()["c"] in ("QUEUED", "READY")
    join = why(dyn, d.run_id, "join")["trigger_rule"]
    assert (join["done"], join["failed"], join["upstream_failed"]) == (2, 1, 1)
    assert "2 of 3 parents done (0 succeeded, 1 failed, 1 upstream failed, 0 skipped)" in join["detail"]
    early = why(dyn, d.run_id, "early")
    assert "early verdict (1 of 2 upstream done)" in early["decided"]["detail"]
    assert early["decided"]["to"] in ("READY", "QUEUED")
    assert "upstream a FAILED" in why(dyn, d.run_id, "b")["decided"]["detail"]
    assert "early verdict (1 of 2 upstream done)" in cli_explain(dyn, d.run_id, "early")


def cli_explain(orc: Orchestrator, run_id: str, key: str) -> str:
    from click.testing import CliRunner

    from orchestrator.cli import app as cli
    from orchestrator.cli import base as cli_base

    original = cli_base._ready_store
    cli_base._ready_store = lambda: orc  # type: ignore[assignment]
    try:
        result = CliRunner().invoke(cli.main, ["explain", run_id, key])
    finally:
        cli_base._ready_store = original  # type: ignore[assignment]
    assert result.exit_code == 0, result.output
    return result.output


def test_explain_is_pure_over_rows_without_the_dynamic_columns() -> None:
    """A row without the dynamic columns (an older store's) is explained as before."""
    row = SimpleNamespace(key="j", state="PENDING", trigger_rule="all_success", n_upstream=2, n_done=1,
                          n_succeeded=1, n_failed=0, n_skipped=0)  # fmt: skip
    data = ExplainInput("RUNNING", [row], [], [], {}, {}, 1, dt.datetime.now(dt.UTC))
    (found,) = explain(data)
    assert (
        found.reasons[0].detail
        == "all_success: 1 of 2 parents done (1 succeeded, 0 failed, 0 skipped); not decided yet"
    )
