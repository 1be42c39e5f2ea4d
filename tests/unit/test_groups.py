"""Task groups (``DAG.group``, Airflow's ``TaskGroup``): prefixed keys, nested groups, the
group's defaults where a node leaves an option at its own, bare keys resolved inside the group, a
group's upstream for its roots and the group as an upstream (its leaves, a teardown left out), the
spec format's round trip, and the refusals."""

from __future__ import annotations

import pytest

from orchestrator import DAG, ValidationError
from orchestrator.core.dag import KEY_RE, dag_from_spec
from orchestrator.core.dag.groups import group_rows, groups_of


def sections() -> DAG:
    dag = DAG("example_task_group")
    start = dag.task("start", "t.a")
    with dag.group("section_1", upstream=[start], max_attempts=3, pool="p") as s1:
        dag.task("task_1", "t.a")
        dag.task("task_2", "t.a", upstream=["task_1"], max_attempts=5)
        dag.task("task_3", "t.a", upstream=["task_1"])
    with dag.group("section_2", upstream=[s1], trigger_rule="all_done") as s2:
        dag.task("task_1", "t.a")
        with dag.group("inner_section_2", upstream=["task_1"], queue="q") as inner:
            dag.task("task_2", "t.a")
            dag.task("task_3", "t.a")
        dag.task("task_4", "t.a", upstream=[inner], trigger_rule="all_success")
    dag.task("end", "t.a", upstream=[s2])
    return dag


def test_keys_are_prefixed_by_the_groups_they_lie_in() -> None:
    dag = sections()
    assert list(dag.nodes) == [
        "start", "section_1.task_1", "section_1.task_2", "section_1.task_3", "section_2.task_1",
        "section_2.inner_section_2.task_2", "section_2.inner_section_2.task_3", "section_2.task_4", "end",
    ]  # fmt: skip
    assert all(KEY_RE.fullmatch(k) for k in dag.nodes)
    assert groups_of("section_2.inner_section_2.task_2") == ["section_2", "section_2.inner_section_2"]
    assert groups_of("start") == []
    dag.validate()


def test_edges_follow_airflows_group_arrows() -> None:
    up = {k: n.upstream for k, n in sections().nodes.items()}
    assert up["section_1.task_1"] == ("start",)  # start >> section_1: the group's root
    assert up["section_1.task_2"] == ("section_1.task_1",)  # a bare key of the same group
    assert up["section_2.task_1"] == ("section_1.task_2", "section_1.task_3")  # section_1 >> section_2: its leaves
    assert up["section_2.inner_section_2.task_2"] == ("section_2.task_1",)
    assert up["section_2.task_4"] == ("section_2.inner_section_2.task_2", "section_2.inner_section_2.task_3")
    assert up["end"] == ("section_2.task_4",)


def test_a_group_lends_its_defaults_where_a_node_leaves_an_option_at_its_own() -> None:
    nodes = sections().nodes
    assert nodes["section_1.task_1"].max_attempts == 3 and nodes["section_1.task_1"].pool == "p"
    assert nodes["section_1.task_2"].max_attempts == 5  # its own
    assert nodes["section_2.task_1"].trigger_rule.value == "all_done"
    assert nodes["section_2.inner_section_2.task_2"].trigger_rule.value == "all_done"  # the outer group's
    assert nodes["section_2.inner_section_2.task_2"].queue == "q"
    assert nodes["section_2.task_4"].trigger_rule.value == "all_success"  # its own
    assert nodes["start"].max_attempts == 1 and nodes["end"].trigger_rule.value == "all_success"


def test_a_groups_leaves_leave_its_teardown_out() -> None:
    dag = DAG("td")
    with dag.group("s") as s:
        dag.task("setup", "t.a", setup=True)
        dag.task("work", "t.a", upstream=["setup"])
        dag.task("teardown", "t.a", upstream=["setup", "work"], teardown=True, trigger_rule=None)
    assert s.leaves() == ["s.work"] and s.roots() == ["s.setup"]
    assert dag.nodes["s.teardown"].trigger_rule.value == "all_done_setup_success"


def test_a_map_inside_a_group_maps_over_a_bare_key_of_the_group() -> None:
    dag = DAG("m")
    with dag.group("g"):
        dag.task("ls", "t.a")
        dag.map("m", "t.a", over="ls", kwarg="x")
    node = dag.nodes["g.m"]
    assert node.upstream == ("g.ls",) and node.map is not None and node.map.args[0].source == "g.ls"
    dag.validate()


def test_groups_round_trip_through_the_spec_format_as_their_keys() -> None:
    dag = sections()
    again = dag_from_spec(dag.to_spec())
    assert again.to_spec() == dag.to_spec()


def test_group_rows_count_a_groups_tasks_by_state() -> None:
    states = {"g.a": "SUCCEEDED", "g.b[0]": "FAILED", "g.h.c": "SUCCEEDED", "x": "READY"}
    assert group_rows(states, states) == {"g": {"SUCCEEDED": 2, "FAILED": 1}, "g.h": {"SUCCEEDED": 1}}


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("a.b", {}, "group name 'a.b' must be 1-64 letters"),
        ("", {}, "group name '' must be"),
        ("g", {"params": {}}, "a group lends its nodes only"),
    ],
)
def test_bad_groups_are_refused(name: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DAG("bad").group(name, **options)


def test_a_group_opened_twice_or_clashing_with_a_key_is_refused() -> None:
    dag = DAG("bad")
    with dag.group("g"):
        dag.task("a", "t.a")
    with pytest.raises(ValidationError, match="opened twice"):
        dag.group("g")
    dag.task("h", "t.a")
    with pytest.raises(ValidationError, match="clashes with a node key"):
        dag.group("h")
    with pytest.raises(ValidationError, match="has no node yet"):
        with dag.group("empty") as empty:
            pass
        dag.task("after", "t.a", upstream=[empty])
