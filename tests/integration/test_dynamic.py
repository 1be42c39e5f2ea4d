"""Dynamic DAGs end to end on a real prefork worker: a wide map and its join, a chained map run
depth first, a branch, a task raising ``orchestrator.Skip``, setup and teardown."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, RunState, TaskState, TriggerRule
from orchestrator.services.invariants import check_runs
from tests.integration.conftest import WorkerProcess

T = TaskState
pytestmark = pytest.mark.integration
D = "tasks.dynamic."
P = "tasks.probes."


def tasks_of(run: Any) -> dict[str, Any]:
    return {t.key: t for t in run.tasks()}


def ran(run: Any) -> Counter[str]:
    """How many accepted claims (-> RUNNING) each task had."""
    return Counter(e.key for e in run.events() if e.accepted and e.to_state == "RUNNING")


def test_a_wide_map_joins_its_results_in_map_order(orc: Orchestrator, worker: WorkerProcess) -> None:
    # Given 1 -> 500 -> 1: a listing, a child per item, a join
    dag = DAG("wide-map")
    ls = dag.task("ls", D + "listing", kwargs={"n": 500})
    m = dag.map("m", D + "item", over=ls, kwarg="x", kwargs={"add": 1})
    dag.task("join", D + "collect", upstream=[m])
    started = time.monotonic()
    run = orc.submit(dag)

    # When it runs
    assert run.wait(timeout=180).state is RunState.SUCCEEDED
    took = time.monotonic() - started

    # Then the join got the 500 results in map order, every child ran once and the map summarises them
    assert run.task("join").result == {"m": [i + 1 for i in range(500)]}
    tasks = tasks_of(run)
    kids = [t for t in tasks.values() if t.map_parent == "m"]
    assert sorted(t.map_index for t in kids) == list(range(500))
    assert all(t.key == f"m[{t.map_index}]" and t.state is T.SUCCEEDED for t in kids)
    header = tasks["m"]
    assert header.state is T.SUCCEEDED
    assert header.map_counts == {"total": 500, "done": 500, "succeeded": 500, "failed": 0, "skipped": 0}
    counts = ran(run)
    assert all(counts[t.key] == 1 for t in kids) and "m" not in counts
    assert check_runs(orc.store, [run.id]) == []
    print(f"1 -> 500 -> 1 map: {took:.1f}s")


def test_a_chained_map_runs_each_item_through_its_stages_depth_first(orc: Orchestrator, worker: WorkerProcess) -> None:
    # Given 50 items through three mapped stages, item by item, and a join
    n = 50
    dag = DAG("chained-map")
    ls = dag.task("ls", D + "listing", kwargs={"n": n})
    s1 = dag.map("s1", D + "item", over=ls, kwarg="x", kwargs={"add": 1})
    s2 = dag.map("s2", D + "item", over=s1, kwarg="x", kwargs={"add": 10})
    s3 = dag.map("s3", D + "item", over=s2, kwarg="x", kwargs={"add": 100})
    dag.task("join", D + "collect", upstream=[s3])
    run = orc.submit(dag)
    assert run.wait(timeout=120).state is RunState.SUCCEEDED

    # Then every item ran each stage exactly once, on the previous stage's result
    tasks = tasks_of(run)
    counts = ran(run)
    for stage in ("s1", "s2", "s3"):
        assert [counts[f"{stage}[{i}]"] for i in range(n)] == [1] * n, stage
        assert tasks[stage].map_counts == {"total": n, "done": n, "succeeded": n, "failed": 0, "skipped": 0}
    assert run.task("join").result == {"s3": [i + 111 for i in range(n)]}
    # and depth first: item 0's last stage started before the last item's first stage finished
    first_done_last = tasks[f"s1[{n - 1}]"].finished_at
    assert tasks["s3[0]"].started_at < first_done_last, (tasks["s3[0]"].started_at, first_done_last)
    # each stage of an item after the one before it
    for i in range(n):
        assert tasks[f"s1[{i}]"].finished_at <= tasks[f"s2[{i}]"].started_at
        assert tasks[f"s2[{i}]"].finished_at <= tasks[f"s3[{i}]"].started_at
    assert check_runs(orc.store, [run.id]) == []


def test_a_branch_runs_only_the_chosen_path(orc: Orchestrator, worker: WorkerProcess) -> None:
    # Given a branch choosing "left" of left/right, a task below right, and a join of both paths
    dag = DAG("branch")
    pick = dag.task("pick", D + "choose", kwargs={"pick": "left"}, branch=True)
    left = dag.task("left", D + "item", kwargs={"x": 1}, upstream=[pick])
    right = dag.task("right", D + "item", kwargs={"x": 2}, upstream=[pick])
    below = dag.task("below_right", D + "item", kwargs={"x": 3}, upstream=[right])
    dag.task("join", D + "collect", upstream=[left, below], trigger_rule=TriggerRule.NONE_FAILED_MIN_ONE_SUCCESS)
    run = orc.submit(dag)
    assert run.wait(timeout=60).state is RunState.SUCCEEDED

    tasks = tasks_of(run)
    assert {k: t.state for k, t in tasks.items()} == {
        "pick": T.SUCCEEDED,
        "left": T.SUCCEEDED,
        "right": T.SKIPPED,
        "below_right": T.SKIPPED,
        "join": T.SUCCEEDED,
    }
    assert tasks["right"].skip_reason == "branch_not_taken"
    assert tasks["below_right"].skip_reason == "upstream_skipped"
    counts = ran(run)
    assert counts["right"] == 0 and counts["below_right"] == 0 and counts["left"] == 1 and counts["join"] == 1
    assert run.task("join").result == {"left": 1}
    assert check_runs(orc.store, [run.id]) == []


def test_a_task_raising_skip_is_skipped_and_its_children_follow_their_rules(
    orc: Orchestrator, worker: WorkerProcess
) -> None:
    dag = DAG("skip")
    s = dag.task("s", D + "skip", kwargs={"reason": "no new files"})
    dag.task("strict", P + "noop", upstream=[s])
    dag.task("tolerant", P + "noop", upstream=[s], trigger_rule=TriggerRule.NONE_FAILED)
    dag.task("all_skipped", P + "noop", upstream=[s], trigger_rule=TriggerRule.ALL_SKIPPED)
    run = orc.submit(dag)
    assert run.wait(timeout=60).state is RunState.SUCCEEDED

    tasks = tasks_of(run)
    assert tasks["s"].state is T.SKIPPED and tasks["s"].skip_reason == "user"
    assert any("no new files" in (e.reason or "") for e in run.events() if e.key == "s" and e.to_state == "SKIPPED")
    assert tasks["strict"].state is T.SKIPPED and tasks["strict"].skip_reason == "upstream_skipped"
    assert tasks["tolerant"].state is T.SUCCEEDED and tasks["all_skipped"].state is T.SUCCEEDED
    assert ran(run)["s"] == 1 and ran(run)["strict"] == 0
    assert check_runs(orc.store, [run.id]) == []


def test_a_teardown_runs_after_a_failure_and_does_not_decide_the_run(orc: Orchestrator, worker: WorkerProcess) -> None:
    # Given setup -> work (fails) -> teardown
    dag = DAG("teardown-after-failure")
    create = dag.task("create", P + "noop", setup=True)
    work = dag.task("work", P + "fail", kwargs={"message": "the middle fails"}, upstream=[create])
    dag.task("delete", P + "noop", upstream=[create, work], teardown=True)
    run = orc.submit(dag)
    # Then the teardown runs anyway, and the run FAILED because of the middle task
    assert run.wait(timeout=60).state is RunState.FAILED
    tasks = tasks_of(run)
    assert tasks["work"].state is T.FAILED and tasks["delete"].state is T.SUCCEEDED
    assert tasks["delete"].started_at >= tasks["work"].finished_at
    closing = [e for e in run.events() if e.key is None and e.to_state == "FAILED"]
    assert closing and "1 task(s) failed" in (closing[0].reason or "")

    # Given setup -> work (succeeds) -> teardown (fails)
    dag = DAG("teardown-fails")
    create = dag.task("create", P + "noop", setup=True)
    work = dag.task("work", P + "noop", upstream=[create])
    dag.task("delete", P + "fail", kwargs={"message": "cleanup failed"}, upstream=[create, work], teardown=True)
    run2 = orc.submit(dag)
    # Then the teardown's failure alone does not fail the run
    assert run2.wait(timeout=60).state is RunState.SUCCEEDED
    assert run2.task("delete").state is T.FAILED and run2.task("work").state is T.SUCCEEDED
    assert check_runs(orc.store, [run.id, run2.id]) == []


def _corruptible_run(orc: Orchestrator) -> str:
    """A finished run: ls -> m (3 items) -> s2 (chained over m) -> join, and ``early`` (one_success) below m."""
    dag = DAG("invariants")
    ls = dag.task("ls", D + "listing", kwargs={"n": 3})
    m = dag.map("m", D + "item", over=ls, kwarg="x", kwargs={"seconds": 0.3})
    s2 = dag.map("s2", D + "item", over=m, kwarg="x")
    dag.task("join", D + "collect", upstream=[s2])
    dag.task("early", P + "noop", upstream=[m], trigger_rule=TriggerRule.ONE_SUCCESS)
    run = orc.submit(dag)
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    assert check_runs(orc.store, [run.id]) == []
    return run.id


CORRUPTIONS = [
    # (what is changed, SQL on the run's orc_tasks, how a line check_runs must report begins)
    (
        "a join started before the map's last child finished",
        "UPDATE orc_tasks SET started_at = (SELECT finished_at FROM orc_tasks WHERE run_id = :r AND key = 's2[2]')"
        " - interval '1 second' WHERE run_id = :r AND key = 'join'",
        "join: started before every child of the map s2 was done (",
    ),
    (
        "a one_success task started before any child finished",
        "UPDATE orc_tasks SET started_at = (SELECT min(finished_at) FROM orc_tasks WHERE run_id = :r"
        " AND map_parent = 'm') - interval '1 second' WHERE run_id = :r AND key = 'early'",
        "early: started (one_success) before any upstream SUCCEEDED finished",
    ),
    (
        "a header counting a child twice",
        "UPDATE orc_tasks SET map_ok = map_ok + 1 WHERE run_id = :r AND key = 'm'",
        "m: closed SUCCEEDED counting done/ok/failed/skipped (3, 4, 0, 0)",
    ),
    (
        "two children at one map index",
        "UPDATE orc_tasks SET map_index = 0 WHERE run_id = :r AND key = 'm[1]'",
        "m: map indexes are not 0..2 once each",
    ),
    (
        "a header whose total is not its child count",
        "UPDATE orc_tasks SET map_total = 4 WHERE run_id = :r AND key = 'm'",
        "m: map_total 4 but 3 children",
    ),
    (
        "a chained child started before its item succeeded",
        "UPDATE orc_tasks SET started_at = (SELECT started_at FROM orc_tasks WHERE run_id = :r AND key = 'm[1]')"
        " WHERE run_id = :r AND key = 's2[1]'",
        "s2[1]: started before its item m[1] succeeded",
    ),
    (
        "a child started before the map's source finished",
        "UPDATE orc_tasks SET started_at = (SELECT started_at FROM orc_tasks WHERE run_id = :r AND key = 'ls')"
        " WHERE run_id = :r AND key = 'm[0]'",
        "m[0]: started before its parent ls finished",
    ),
]


@pytest.mark.parametrize(("what", "sql", "line"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_the_invariant_checker_catches_a_broken_map(
    orc: Orchestrator, worker: WorkerProcess, what: str, sql: str, line: str
) -> None:
    import sqlalchemy as sa

    run_id = _corruptible_run(orc)
    with orc.store.engine.begin() as conn:
        conn.execute(sa.text(sql), {"r": run_id})
    problems = check_runs(orc.store, [run_id])
    assert any(p.startswith(f"{run_id}.{line}") for p in problems), (what, problems)
