"""The issue's target: a 20-node DAG with retries, a map, a branch and a 24 h sleep, tested
through the production transitions in well under a second of wall time once the database is
up (the timing is printed, not asserted: the machine is shared)."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest

from orchestrator import DAG, Backoff, TaskState
from orchestrator.testing import FailTimes, Kit

pytestmark = pytest.mark.postgres


def twenty_nodes() -> DAG:
    dag = DAG("nightly")
    retry: dict[str, Any] = {"max_attempts": 3, "backoff": Backoff(base=30, cap=300)}
    extracts = [dag.task(f"extract_{s}", "kit.value", kwargs={"x": i + 1}, **retry) for i, s in enumerate("abc")]
    listing = dag.task("listing", "kit.listing", kwargs={"n": 4}, upstream=extracts)
    dag.map("squares", "kit.square", over=listing, kwarg="item", **retry)
    pick = dag.task("pick", "kit.pick", upstream=["squares"], branch=True)
    big = dag.task("big", "kit.value", kwargs={"x": 100}, upstream=[pick])
    small = dag.task("small", "kit.value", kwargs={"x": 1}, upstream=[pick])
    nap = dag.wait("nap", delay=24 * 3600, upstream=[big, small], trigger_rule="none_failed_min_one_success")
    previous = dag.task("total", "kit.total", upstream=[*extracts, nap])
    for i in range(1, 11):
        previous = dag.task(f"step_{i}", "kit.value", kwargs={"x": i}, upstream=[previous], **retry)
    assert len(dag.nodes) == 20
    return dag


def test_twenty_nodes_with_retries_a_map_a_branch_and_a_day_of_sleep(orchestrator: Kit) -> None:
    dag = twenty_nodes()
    faults = {
        "extract_b": FailTimes(2, exc=ConnectionError),
        "squares": FailTimes(1, exc=ConnectionError),
        "step_5": FailTimes(1, exc=TimeoutError),
    }
    began = time.perf_counter()
    result = orchestrator.run_dag(dag, faults=faults)
    took = time.perf_counter() - began
    print(
        f"\n20-node DAG (retries, a map of 4, a branch, a 24 h sleep): {took * 1000:.0f} ms of wall time,"
        f" {len(result.deliveries)} messages, {result.elapsed} of virtual time"
    )
    assert result.state == "SUCCEEDED", result.explain()
    assert result.states["small"] == TaskState.SKIPPED and result.results["pick"] == "big"
    assert [result.results[f"squares[{i}]"] for i in range(4)] == [1, 4, 9, 16]
    assert result.attempts["extract_b"] == 3 and result.attempts["squares[0]"] == 2 and result.attempts["step_5"] == 2
    assert result.results["total"] == 6.0 and result.results["step_10"] == 10
    assert result.elapsed >= dt.timedelta(hours=24)
