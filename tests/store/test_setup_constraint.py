"""Airflow's setup constraint (``trigger_rule_dep._evaluate_setup_constraint``): a task decides
on the setups it works under without being their child (its setup scope: a setup above it with
no teardown, or a teardown below it) beside its trigger rule. One that failed makes it
UPSTREAM_FAILED and one skipped SKIPPED, whatever its rule; it waits until they are all done. A
setup whose teardown is above the task is out of its scope. The workers' part is played by
``dynamic.drive``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, Skip
from orchestrator.core.dag.scopes import setup_scopes
from orchestrator.services.invariants import check_runs
from tests.store.dynamic import Fail, drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def body(outcomes: dict[str, str]) -> Any:
    """A body that fails or skips the keys ``outcomes`` names and succeeds the others."""

    def run(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if outcomes.get(key) == "fail":
            raise Fail(f"{key} fails")
        if outcomes.get(key) == "skip":
            raise Skip(f"{key} skips")
        return key

    return run


def two_levels() -> DAG:
    """create (setup) -> work -> report (all_done) -> delete (its teardown): ``report``'s setup
    is two levels up, its teardown below it."""
    dag = DAG("scope")
    dag.task("create", "t", setup=True)
    dag.task("work", "t", upstream=["create"])
    dag.task("report", "t", upstream=["work"], trigger_rule="all_done")
    dag.task("delete", "t", upstream=["create", "report"], teardown=True)
    return dag


def test_the_scope_is_the_setups_above_a_task_with_a_teardown_below_it() -> None:
    dag = two_levels()
    dag.task("after", "t", upstream=["delete"], trigger_rule="all_done")  # below the teardown: out of scope
    assert setup_scopes(dag.nodes) == {"report": ["create"]}  # work is its child; delete a teardown


@pytest.mark.parametrize(("outcome", "report"), [("fail", "UPSTREAM_FAILED"), ("skip", "SKIPPED")])
def test_a_setup_that_failed_or_skipped_two_levels_up_decides_an_all_done_task(
    orc: Orchestrator, outcome: str, report: str
) -> None:
    d = drive(orc, two_levels(), body({"create": outcome}))
    states = d.states()
    assert states["report"] == report  # all_done alone would run it (its parent work is done)
    assert "report" not in [k for k, _, _ in d.ran]
    assert states["work"] == ("UPSTREAM_FAILED" if outcome == "fail" else "SKIPPED")
    assert check_runs(orc.store, [d.run_id]) == []


def test_a_task_whose_setup_succeeded_follows_its_rule(orc: Orchestrator) -> None:
    d = drive(orc, two_levels(), body({"work": "fail"}))
    assert d.states() == {"create": "SUCCEEDED", "work": "FAILED", "report": "SUCCEEDED", "delete": "SUCCEEDED"}
    assert d.run_state() == "FAILED"


def waits() -> DAG:
    """``join`` (one_success) has a root parent that succeeds first and the setup two levels up:
    its rule says READY before the setup is done."""
    dag = DAG("scope-wait")
    dag.task("a_root", "t")
    dag.task("setup", "t", setup=True)
    dag.task("mid", "t", upstream=["setup"], trigger_rule="always")
    dag.task("join", "t", upstream=["a_root", "mid"], trigger_rule="one_success")
    return dag


def test_a_task_waits_for_its_scope_and_is_decided_when_the_setup_finishes(orc: Orchestrator) -> None:
    d = drive(orc, waits(), body({}))
    order = [k for k, _, _ in d.ran]
    assert order.index("setup") < order.index("join"), order
    assert d.run_state() == "SUCCEEDED"
    failed = drive(orc, waits(), body({"setup": "fail"}))
    assert failed.states()["join"] == "UPSTREAM_FAILED"  # its rule said READY once a_root succeeded
    assert "join" not in [k for k, _, _ in failed.ran]
    assert check_runs(orc.store, [d.run_id, failed.run_id]) == []


def test_a_setup_whose_teardown_is_above_the_task_is_out_of_its_scope(orc: Orchestrator) -> None:
    dag = DAG("out-of-scope")
    dag.task("create", "t", setup=True)
    dag.task("work", "t", upstream=["create"])
    dag.task("delete", "t", upstream=["create", "work"], teardown=True)
    dag.task("after", "t", upstream=["delete"], trigger_rule="all_done")
    d = drive(orc, dag, body({"create": "fail"}))
    assert d.states()["after"] == "SUCCEEDED"


def test_a_cleared_task_waits_for_its_cleared_setup(orc: Orchestrator) -> None:
    d = drive(orc, two_levels(), body({}))
    assert d.run_state() == "SUCCEEDED"
    orc.clear(d.run_id, "report")  # takes create and delete along (Airflow's clear)
    again = drive(orc, two_levels(), body({"create": "fail"}), run_id=d.run_id)
    assert again.states()["report"] == "UPSTREAM_FAILED"
    assert [k for k, _, _ in again.ran] == ["create"]
    assert check_runs(orc.store, [d.run_id]) == []


def test_explain_names_the_setups_a_held_task_waits_for(orc: Orchestrator) -> None:
    d = drive(orc, waits(), body({}), until=lambda d: any(k == "a_root" for k, _, _ in d.ran))
    assert d.states()["join"] == "PENDING"  # its rule says READY: a_root succeeded
    (found,) = orc.explain(d.run_id, "join")
    reasons = {r.kind: r for r in found.reasons}
    assert reasons["waiting_on_setup_scope"].data == {"setups": {"setup": "QUEUED"}}
    assert "Airflow's setup constraint" in reasons["waiting_on_setup_scope"].detail
