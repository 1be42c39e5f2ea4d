"""Airflow's own example DAGs ported to this project's API and run on a real worker: every
task's final state must be the state Airflow gives it (0 mismatches), and the branch linter
raises no false warning on them. The expected states are derived from Airflow's trigger-rule
semantics (``airflow/ti_deps/deps/trigger_rule_dep.py``; the examples are in
``airflow/example_dags/``) and the reason for each is written beside it. The branch choices are
fixed (Airflow's ``example_branch_operator`` picks at random) so that the states are known.

Airflow's operators become: ``EmptyOperator`` -> ``tasks.probes.noop``; a
``BranchPythonOperator`` -> ``tasks.dynamic.choose`` with ``branch=True`` (it returns the key to
follow); a task raising ``AirflowSkipException`` -> ``tasks.dynamic.skip`` (raises
``orchestrator.Skip``)."""

from __future__ import annotations

from orchestrator import DAG, Orchestrator, RunState
from tests.integration.conftest import WorkerProcess

NOOP, CHOOSE, SKIP = "tasks.probes.noop", "tasks.dynamic.choose", "tasks.dynamic.skip"
OK, SKIPPED = "SUCCEEDED", "SKIPPED"


def run(orc: Orchestrator, dag: DAG) -> tuple[RunState, dict[str, str]]:
    assert dag.lint() == [], dag.lint()  # no false warning from the branch linter
    handle = orc.submit(dag)
    state = handle.wait(timeout=120).state
    return state, {t.key: t.state.value for t in handle.tasks()}


def test_example_branch_operator(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("example_branch_operator")
    dag.task("run_this_first", NOOP)
    dag.task("branching", CHOOSE, kwargs={"pick": "branch_b"}, upstream=["run_this_first"], branch=True)
    follows = []
    for x in "abcd":
        dag.task(f"branch_{x}", NOOP, upstream=["branching"])
        follows.append(dag.task(f"follow_branch_{x}", NOOP, upstream=[f"branch_{x}"]))
    dag.task("join", NOOP, upstream=follows, trigger_rule="none_failed_min_one_success")
    state, states = run(orc, dag)
    expected = {
        "run_this_first": OK,
        "branching": OK,  # a branch task succeeds; it skips the children it did not follow
        "branch_b": OK,  # followed
        "follow_branch_b": OK,  # all_success: its one parent succeeded
        **{f"branch_{x}": SKIPPED for x in "acd"},  # not followed (Airflow: skipped by the branch)
        **{f"follow_branch_{x}": SKIPPED for x in "acd"},  # all_success with a skipped parent: skipped
        "join": OK,  # none_failed_min_one_success: no failure, one success (follow_branch_b)
    }
    assert states == expected and state is RunState.SUCCEEDED


def test_example_nested_branch_dag(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("example_nested_branch_dag")
    dag.task("branch_1", CHOOSE, kwargs={"pick": "true_1"}, branch=True)
    dag.task("true_1", NOOP, upstream=["branch_1"])
    dag.task("false_1", NOOP, upstream=["branch_1"])
    dag.task("branch_2", CHOOSE, kwargs={"pick": "true_2"}, upstream=["false_1"], branch=True)
    dag.task("true_2", NOOP, upstream=["branch_2"])
    dag.task("false_2", NOOP, upstream=["branch_2"])
    dag.task("join_2", NOOP, upstream=["true_2", "false_2"], trigger_rule="none_failed_min_one_success")
    dag.task("false_3", NOOP, upstream=["join_2"])
    dag.task("join_1", NOOP, upstream=["true_1", "false_3"], trigger_rule="none_failed_min_one_success")
    state, states = run(orc, dag)
    expected = {
        "branch_1": OK,
        "true_1": OK,  # followed
        "false_1": SKIPPED,  # not followed
        "branch_2": SKIPPED,  # all_success with its parent skipped: it never runs, so it picks nothing
        "true_2": SKIPPED,  # all_success, parent skipped
        "false_2": SKIPPED,  # all_success, parent skipped
        "join_2": SKIPPED,  # none_failed_min_one_success with every parent skipped: skipped (the docstring's point)
        "false_3": SKIPPED,  # all_success, parent skipped
        "join_1": OK,  # none_failed_min_one_success: true_1 succeeded, false_3 skipped, nothing failed
    }
    assert states == expected and state is RunState.SUCCEEDED


def test_example_skip_dag(orc: Orchestrator, worker: WorkerProcess) -> None:
    dag = DAG("example_skip_dag")
    for suffix, rule in (("1", "all_success"), ("2", "one_success")):
        dag.task(f"skip_operator_{suffix}", SKIP)  # raises AirflowSkipException there, Skip here
        dag.task(f"always_true_{suffix}", NOOP)
        dag.task(rule, NOOP, upstream=[f"skip_operator_{suffix}", f"always_true_{suffix}"], trigger_rule=rule)
        dag.task(f"final_{suffix}", NOOP, upstream=[rule])
    state, states = run(orc, dag)
    expected = {
        "skip_operator_1": SKIPPED,  # skipped itself
        "always_true_1": OK,
        "all_success": SKIPPED,  # all_success with a skipped parent: skipped
        "final_1": SKIPPED,  # all_success, parent skipped
        "skip_operator_2": SKIPPED,
        "always_true_2": OK,
        "one_success": OK,  # one_success: always_true_2 succeeded
        "final_2": OK,  # all_success: its parent succeeded
    }
    assert states == expected and state is RunState.SUCCEEDED  # skips are not failures


def test_example_short_circuit_operator(orc: Orchestrator, worker: WorkerProcess) -> None:
    """Airflow's ``@task.short_circuit``: a falsy result skips what is below; with
    ``ignore_downstream_trigger_rules=False`` only the direct children, the rest by their rules."""
    dag = DAG("example_short_circuit_operator")
    dag.task("condition_is_true", CHOOSE, kwargs={"pick": "yes"}, short_circuit=True)  # truthy
    dag.task("condition_is_false", CHOOSE, kwargs={"pick": ""}, short_circuit=True)  # falsy
    for side, up in (("true", "condition_is_true"), ("false", "condition_is_false")):
        dag.task(f"{side}_1", NOOP, upstream=[up])
        dag.task(f"{side}_2", NOOP, upstream=[f"{side}_1"])
    # chain(task_1, [task_2, short_circuit], [task_3, task_4], [task_5, task_6], task_7)
    dag.task("task_1", NOOP)
    dag.task("task_2", NOOP, upstream=["task_1"])
    dag.task("short_circuit", CHOOSE, kwargs={"pick": ""}, upstream=["task_1"], short_circuit=True,
             ignore_downstream_trigger_rules=False)  # fmt: skip
    dag.task("task_3", NOOP, upstream=["task_2"])
    dag.task("task_4", NOOP, upstream=["short_circuit"])
    dag.task("task_5", NOOP, upstream=["task_3"])
    dag.task("task_6", NOOP, upstream=["task_4"])
    dag.task("task_7", NOOP, upstream=["task_5", "task_6"], trigger_rule="all_done")
    state, states = run(orc, dag)
    expected = {
        "condition_is_true": OK, "true_1": OK, "true_2": OK,  # a truthy result skips nothing
        "condition_is_false": OK,  # a short circuit succeeds; its falsy result skips what is below
        "false_1": SKIPPED, "false_2": SKIPPED,  # ignore_downstream_trigger_rules=True: all below, whatever their rules
        "task_1": OK, "task_2": OK, "task_3": OK, "task_5": OK,
        "short_circuit": OK,
        "task_4": SKIPPED,  # its direct child: skipped by the short circuit
        "task_6": SKIPPED,  # all_success with a skipped parent: skipped by its own rule
        "task_7": OK,  # all_done: every parent done (task_5 succeeded, task_6 skipped): runs
    }  # fmt: skip
    assert states == expected and state is RunState.SUCCEEDED


ITEM, TIMES, COLLECT, AS_KWARGS = "tasks.dynamic.item", "tasks.dynamic.times", "tasks.dynamic.collect", \
    "tasks.dynamic.as_item_kwargs"  # fmt: skip


def test_example_dynamic_task_mapping(orc: Orchestrator, worker: WorkerProcess) -> None:
    """``add_one.expand(x=[1, 2, 3])`` then ``sum_it(added_values)``: a map over a literal list and
    a join that gets the children's results in map order."""
    dag = DAG("example_dynamic_task_mapping")
    dag.map("add_one", ITEM, over=[1, 2, 3], kwarg="x", kwargs={"add": 1})
    dag.task("sum_it", COLLECT, upstream=["add_one"])
    handle = orc.submit(dag)
    assert handle.wait(timeout=120).state is RunState.SUCCEEDED
    by_key = {t.key: t for t in handle.tasks()}
    assert {k: t.state.value for k, t in by_key.items()} == {
        "add_one": OK, "add_one[0]": OK, "add_one[1]": OK, "add_one[2]": OK, "sum_it": OK,
    }  # fmt: skip
    assert by_key["sum_it"].result == {"add_one": [2, 3, 4]}  # Airflow's "Total was 9"


def test_example_task_mapping_second_order(orc: Orchestrator, worker: WorkerProcess) -> None:
    """``add_10.expand(num=times_2.expand(num=get_nums()))``: a map over a task's result, and a map
    over that map (here item by item; Airflow waits for the whole first map, the results are equal)."""
    dag = DAG("example_task_mapping_second_order")
    dag.task("get_nums", ITEM, kwargs={"x": [1, 2, 3]})  # returns its list unchanged
    dag.map("times_2", TIMES, over="get_nums", kwarg="x")
    dag.map("add_10", ITEM, over="times_2", kwarg="x", kwargs={"add": 10})
    handle = orc.submit(dag)
    assert handle.wait(timeout=120).state is RunState.SUCCEEDED
    got = {t.key: t.result for t in handle.tasks() if "[" in t.key}
    assert got == {"times_2[0]": 2, "times_2[1]": 4, "times_2[2]": 6, "add_10[0]": 12, "add_10[1]": 14, "add_10[2]": 16}


def test_airflows_mapping_forms_on_a_worker(orc: Orchestrator, worker: WorkerProcess) -> None:
    """A dict's ``[key, value]`` pairs through a transform (Airflow's ``.map(fn)``, its
    ``AirflowSkipException`` a :class:`Skip`) into ``expand_kwargs``; a chained map's ``None``
    results dropped (``skip_none``); a zip to the shortest; under ``run_state="leaves"``."""
    dag = DAG("mapping_forms", run_state="leaves")
    dag.task("sizes", ITEM, kwargs={"x": {"eu": 3, "us": None, "apac": 5}})
    dag.map("by_region", ITEM, kwargs_from="sizes", items="pairs", transform=AS_KWARGS)
    dag.map("odd_or_none", ITEM, over=[1, None, 3, None], kwarg="x")  # returns its item: 1, None, 3, None
    dag.map("evens", TIMES, over="odd_or_none", kwarg="x", skip_none=True)
    dag.map("zipped", ITEM, over={"x": [1, 2, 3], "add": [100, 200]}, combine="zip")
    dag.task("report", COLLECT, upstream=["by_region", "evens", "zipped"], trigger_rule="all_done")
    handle = orc.submit(dag)
    assert handle.wait(timeout=120).state is RunState.SUCCEEDED
    by_key = {t.key: t for t in handle.tasks()}
    assert by_key["by_region[us]"].state.value == SKIPPED  # the transform skipped it: None value
    assert by_key["report"].result == {
        "by_region": [3 + 2, 5 + 4],  # x + len(name): eu, apac
        "evens": [2, 6],  # 1 and 3 doubled: the None results were dropped
        "zipped": [101, 202],  # zipped to the shortest
    }


FAIL = "tasks.probes.fail"
UPSTREAM_FAILED = "UPSTREAM_FAILED"


def example_setup_teardown(root_setup: str = NOOP) -> DAG:
    """Airflow's ``example_setup_teardown`` (its task group's keys prefixed by hand):
    ``root_normal >> section_1`` joins the group's root, its setup."""
    dag = DAG("example_setup_teardown")
    dag.task("root_setup", root_setup, setup=True)
    dag.task("normal", NOOP, upstream=["root_setup"])
    dag.task("root_teardown", NOOP, upstream=["normal", "root_setup"], teardown=True)
    dag.task("section_1__taskgroup_setup", NOOP, upstream=["normal"], setup=True)
    dag.task("section_1__normal", NOOP, upstream=["section_1__taskgroup_setup"])
    dag.task(
        "section_1__taskgroup_teardown", NOOP, upstream=["section_1__normal", "section_1__taskgroup_setup"],
        teardown=True,
    )  # fmt: skip
    return dag


def test_example_setup_teardown(orc: Orchestrator, worker: WorkerProcess) -> None:
    state, states = run(orc, example_setup_teardown())
    assert set(states.values()) == {OK} and state is RunState.SUCCEEDED
    failed_state, failed = run(orc, example_setup_teardown(root_setup=FAIL))
    assert failed == {
        "root_setup": "FAILED",
        "normal": UPSTREAM_FAILED,  # all_success
        "root_teardown": UPSTREAM_FAILED,  # all_done_setup_success with no setup succeeded
        "section_1__taskgroup_setup": UPSTREAM_FAILED,  # all_success (a setup too)
        "section_1__normal": UPSTREAM_FAILED,
        "section_1__taskgroup_teardown": UPSTREAM_FAILED,  # its setup did not succeed
    }
    assert failed_state is RunState.FAILED


def example_setup_teardown_taskflow(outer_setup: str = NOOP, inner_rule: str = "all_success") -> DAG:
    """Airflow's ``example_setup_teardown_taskflow``: ``with outer_teardown(outer_setup()):``
    around ``outer_work`` and ``section_1`` (whose leaves leave its teardown out)."""
    dag = DAG("example_setup_teardown_taskflow")
    dag.task("my_first_task", NOOP, setup=True)
    dag.task("my_second_task", NOOP, upstream=["my_first_task"])
    dag.task("my_third_task", NOOP, upstream=["my_second_task", "my_first_task"], teardown=True)
    dag.task("outer_setup", outer_setup, setup=True)
    dag.task("outer_work", NOOP, upstream=["outer_setup"])
    dag.task("section_1__inner_setup", NOOP, upstream=["outer_setup"], setup=True)
    dag.task("section_1__inner_work", NOOP, upstream=["section_1__inner_setup"], trigger_rule=inner_rule)
    dag.task("section_1__inner_teardown", NOOP, upstream=["section_1__inner_work", "section_1__inner_setup"],
             teardown=True)  # fmt: skip
    dag.task("outer_teardown", NOOP, upstream=["outer_setup", "outer_work", "section_1__inner_work"], teardown=True)
    return dag


def test_example_setup_teardown_taskflow(orc: Orchestrator, worker: WorkerProcess) -> None:
    state, states = run(orc, example_setup_teardown_taskflow())
    assert set(states.values()) == {OK} and state is RunState.SUCCEEDED
    # the setup scope: inner_work with all_done runs once its parent is done, but outer_setup, two
    # levels up with its teardown below inner_work, failed: Airflow's setup constraint makes it
    # UPSTREAM_FAILED (it would have run on a resource that was never set up)
    failed_state, failed = run(orc, example_setup_teardown_taskflow(outer_setup=FAIL, inner_rule="all_done"))
    assert failed == {
        "my_first_task": OK, "my_second_task": OK, "my_third_task": OK,  # another setup's scope
        "outer_setup": "FAILED",
        "outer_work": UPSTREAM_FAILED,
        "section_1__inner_setup": UPSTREAM_FAILED,
        "section_1__inner_work": UPSTREAM_FAILED,  # all_done alone would run it: the setup constraint
        "section_1__inner_teardown": UPSTREAM_FAILED,  # its setup did not succeed
        "outer_teardown": UPSTREAM_FAILED,  # all_done_setup_success with no setup succeeded
    }  # fmt: skip
    assert failed_state is RunState.FAILED


def test_example_task_group(orc: Orchestrator, worker: WorkerProcess) -> None:
    """Airflow's ``example_task_group``: ``start >> section_1 >> section_2 >> end`` with a nested
    group, its keys as Airflow's task ids (``section_2.inner_section_2.task_4``)."""
    dag = DAG("example_task_group")
    start = dag.task("start", NOOP)
    with dag.group("section_1", upstream=[start]) as section_1:
        dag.task("task_1", NOOP)
        dag.task("task_2", NOOP, upstream=["task_1"])
        dag.task("task_3", NOOP, upstream=["task_1"])
    with dag.group("section_2", upstream=[section_1]) as section_2:
        dag.task("task_1", NOOP)
        with dag.group("inner_section_2"):
            dag.task("task_2", NOOP)
            dag.task("task_3", NOOP)
            dag.task("task_4", NOOP, upstream=["task_2", "task_3"])
    dag.task("end", NOOP, upstream=[section_2])
    edges = {(p, k) for k, n in dag.nodes.items() for p in n.upstream}
    assert edges == {  # Airflow's graph of the example
        ("start", "section_1.task_1"), ("section_1.task_1", "section_1.task_2"),
        ("section_1.task_1", "section_1.task_3"),
        *((f"section_1.task_{i}", k) for i in (2, 3) for k in (
            "section_2.task_1", "section_2.inner_section_2.task_2", "section_2.inner_section_2.task_3")),
        ("section_2.inner_section_2.task_2", "section_2.inner_section_2.task_4"),
        ("section_2.inner_section_2.task_3", "section_2.inner_section_2.task_4"),
        ("section_2.task_1", "end"), ("section_2.inner_section_2.task_4", "end"),
    }  # fmt: skip
    state, states = run(orc, dag)
    assert set(states.values()) == {OK} and len(states) == 9 and state is RunState.SUCCEEDED


def test_example_branch_labels(orc: Orchestrator, worker: WorkerProcess) -> None:
    """Airflow's ``example_branch_labels``: ``check_integrity >> Label("No errors") >> save`` and
    ``>> Label("Errors found") >> describe_integrity``. A label changes nothing in the run (every
    task an ``EmptyOperator`` with ``all_success``: all SUCCESS in Airflow); the run keeps the
    labels in its DAG snapshot and its drawing writes them on the arrows."""
    from orchestrator.core import graph as drawing
    from orchestrator.web.drawing import run_graph

    dag = DAG("example_branch_labels")
    ingest = dag.task("ingest", NOOP)
    analyse = dag.task("analyze", NOOP, upstream=[ingest])
    check = dag.task("check_integrity", NOOP, upstream=[analyse])
    save = dag.task("save", NOOP, upstream=[check])
    describe = dag.task("describe_integrity", NOOP, upstream=[check])
    error = dag.task("email_error", NOOP, upstream=[describe])
    dag.task("report", NOOP, upstream=[save, error])
    dag.label(check, save, "No errors")
    dag.label(check, describe, "Errors found")
    handle = orc.submit(dag)
    assert handle.wait(timeout=120).state is RunState.SUCCEEDED
    states = {t.key: t.state.value for t in handle.tasks()}
    assert states == dict.fromkeys(dag.nodes, OK)  # every task succeeds, as in Airflow
    picture = run_graph(orc, handle.id)
    key_of = {b.id: b.keys[0] for b in picture.boxes}
    assert {(key_of[a], key_of[b]): text for (a, b), text in picture.labels.items()} == {
        ("check_integrity", "save"): "No errors",
        ("check_integrity", "describe_integrity"): "Errors found",
    }
    assert '-- "No errors" -->' in drawing.to_mermaid(picture)
