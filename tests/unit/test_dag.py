"""DAG model and validation: every refusal is typed and names the node."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator import DAG, CycleError, SpecError, UnknownTaskError, ValidationError
from orchestrator.core.dag import SizeLimits, dag_from_spec, load_spec, parse_spec

REGISTERED = {"t.a", "t.b"}


def ok(name: str) -> bool:
    return name in REGISTERED


def small() -> DAG:
    dag = DAG("d")
    a = dag.task("a", "t.a")
    dag.task("b", "t.b", upstream=[a])
    return dag


def test_valid_dag_passes_and_roots() -> None:
    dag = small()
    dag.validate(ok)
    assert [n.key for n in dag.roots()] == ["a"]


def test_signature_like_mapping_is_split_into_name_and_arguments() -> None:
    dag = DAG("d")
    node = dag.task("a", {"task": "t.a", "args": (1,), "kwargs": {"x": 2}, "options": {}}, kwargs={"y": 3})
    assert (node.task, node.args, dict(node.kwargs)) == ("t.a", (1,), {"x": 2, "y": 3})


def test_celery_signature_is_accepted() -> None:
    from tasks.probes import echo

    dag = DAG("d")
    node = dag.task("a", echo.s(day="2026-04-25"))
    assert node.task == "tasks.probes.echo"
    assert dict(node.kwargs) == {"day": "2026-04-25"}


def test_cycle_is_named() -> None:
    dag = DAG("d")
    dag.task("a", "t.a", upstream=["c"])
    dag.task("b", "t.a", upstream=["a"])
    dag.task("c", "t.a", upstream=["b"])
    with pytest.raises(CycleError) as info:
        dag.validate(ok)
    cycle = info.value.cycle
    assert cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert "->" in str(info.value)


def test_self_dependency_is_a_cycle() -> None:
    dag = DAG("d")
    dag.task("a", "t.a", upstream=["a"])
    with pytest.raises(CycleError, match="a -> a"):
        dag.validate(ok)


@pytest.mark.parametrize(
    ("build", "error", "fragment"),
    [
        (lambda d: d.task("a", "t.a", upstream=["zz"]), ValidationError, "unknown upstream key 'zz'"),
        (lambda d: d.task("a", "os.system"), UnknownTaskError, "not registered"),
        (lambda d: d.task("a", "celery.chord_unlock"), UnknownTaskError, "internal to Celery"),
        (lambda d: d.task("a", "t.a", max_attempts=0), ValidationError, "max_attempts must be 1 to 1000"),
        (lambda d: d.task("a", "t.a", kwargs={"x": float("nan")}), ValidationError, "not JSON"),
        (lambda d: d.task("a", "t.a", kwargs={"x": float("inf")}), ValidationError, "not JSON"),
        (lambda d: d.task("a", "t.a", kwargs={"x": {1, 2}}), ValidationError, "set"),
        (lambda d: d.task("a", "t.a", args=[b"raw"]), ValidationError, "bytes"),
        (lambda d: d.task("a", "t.a", kwargs={"x": object()}), ValidationError, "object"),
        (lambda d: d.task("a", "t.a", kwargs={"x": {1: 2}}), ValidationError, "non-string key"),
        (lambda d: d.task("bad key!", "t.a"), ValidationError, "node key"),
        (lambda d: d.task("a", "t.a", soft_time_limit=5, time_limit=5), ValidationError, "soft_time_limit"),
        (lambda d: d.task("a", "t.a", time_limit=-1), ValidationError, "time_limit"),
        (lambda d: d.task("a", "t.a", backoff={"base": 0}), ValidationError, "backoff"),
        (lambda d: d.task("a", "t.a", queue="bad queue"), ValidationError, "queue"),
        (lambda d: d.task("a", "t.a", upstream=["b", "b"]) and d.task("b", "t.a"), ValidationError, "twice"),
    ],
)
def test_bad_nodes_are_refused_naming_the_node(build: Any, error: type[Exception], fragment: str) -> None:
    dag = DAG("d")
    if fragment == "twice":
        dag.task("b", "t.a")
        dag.task("a", "t.a", upstream=["b", "b"])
    else:
        build(dag)
    with pytest.raises(error) as info:
        dag.validate(ok)
    assert fragment in str(info.value)
    assert info.value.node in ("a", "bad key!")  # type: ignore[attr-defined]


def test_unknown_trigger_rule_is_refused_at_once() -> None:
    with pytest.raises(ValidationError, match="unknown trigger_rule 'sometimes'"):
        DAG("d").task("a", "t.a", trigger_rule="sometimes")


def test_duplicate_key_is_refused() -> None:
    dag = DAG("d")
    dag.task("a", "t.a")
    with pytest.raises(ValidationError, match="duplicate node key"):
        dag.task("a", "t.b")


def test_empty_dag_and_bad_tenant() -> None:
    with pytest.raises(ValidationError, match="no nodes"):
        DAG("d").validate(ok)
    dag = DAG("d", tenant="has space")
    dag.task("a", "t.a")
    with pytest.raises(ValidationError, match="tenant"):
        dag.validate(ok)


def test_size_limits() -> None:
    dag = DAG("d")
    for i in range(5):
        dag.task(f"n{i}", "t.a")
    with pytest.raises(ValidationError, match="exceed the limit of 4"):
        dag.validate(ok, SizeLimits(max_nodes=4))
    big = DAG("d")
    big.task("a", "t.a", kwargs={"blob": "x" * 2000})
    with pytest.raises(ValidationError, match="arguments exceed 1000 bytes"):
        big.validate(ok, SizeLimits(max_node_bytes=1000))


def test_hundred_thousand_nodes_validate_with_default_limits() -> None:
    dag = DAG("wide")
    root = dag.task("root", "t.a")
    for i in range(99_998):
        dag.task(f"n{i}", "t.a", upstream=[root], kwargs={"i": i})
    dag.task("sink", "t.b", upstream=[f"n{i}" for i in range(0, 99_998, 1000)])
    dag.validate(ok)


def test_long_chain_cycle_detection_is_iterative() -> None:
    dag = DAG("chain")
    prev = dag.task("n0", "t.a")
    for i in range(1, 20_000):
        prev = dag.task(f"n{i}", "t.a", upstream=[prev])
    dag.validate(ok)


SPEC = {
    "name": "revenue",
    "tenant": "acme",
    "priority": "high",
    "params": {"day": "2026-04-25"},
    "deadline": 3600,
    "on_deadline": "cancel",
    "nodes": [
        {"key": "a", "task": "t.a", "kwargs": {"day": "2026-04-25"}, "deadline": 600.5},
        {
            "key": "b",
            "task": "t.b",
            "upstream": ["a"],
            "trigger_rule": "all_done",
            "max_attempts": 3,
            "backoff": {"base": 0.5, "cap": 4, "jitter": "equal"},
            "soft_time_limit": 5,
            "time_limit": 10,
            "priority": "low",
            "queue": "special",
        },
    ],
}


def test_spec_round_trip() -> None:
    dag = dag_from_spec(SPEC)
    dag.validate(ok)
    b = dag.nodes["b"]
    assert b.max_attempts == 3 and b.backoff.jitter.value == "equal" and b.queue == "special"
    assert (dag.deadline, dag.on_deadline.value, dag.nodes["a"].deadline, b.deadline) == (3600, "cancel", 600.5, None)
    again = dag_from_spec(dag.to_spec())
    assert again.to_spec() == dag.to_spec()
    assert again.to_spec()["deadline"] == 3600 and again.to_spec()["on_deadline"] == "cancel"
    assert dag.with_tenant("other").to_spec() == {**dag.to_spec(), "tenant": "other"}
    # the defaults leave the fields out of the spec
    plain = dag_from_spec({"name": "p", "nodes": [{"key": "a", "task": "t.a"}]})
    assert {"deadline", "on_deadline"}.isdisjoint(plain.to_spec())
    assert "deadline" not in plain.to_spec()["nodes"][0]


def test_spec_files(tmp_path: Path) -> None:
    j = tmp_path / "d.json"
    j.write_text(json.dumps(SPEC))
    y = tmp_path / "d.yaml"
    y.write_text("name: y\nnodes:\n  - {key: a, task: t.a}\n")
    assert load_spec(j).name == "revenue"
    assert load_spec(y).nodes["a"].task == "t.a"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ([1, 2], "must be a mapping"),
        ({"nodes": []}, "'name' must be a string"),
        ({"name": "x", "nodes": "a"}, "'nodes' must be a list"),
        ({"name": "x", "nodes": [{"key": "a"}]}, "missing 'task'"),
        ({"name": "x", "nodes": [{"key": "a", "task": "t.a", "retries": 3}]}, "unknown field(s) ['retries']"),
        ({"name": "x", "colour": 1, "nodes": []}, "unknown top-level field(s) ['colour']"),
        ({"name": "x", "nodes": [{"key": "a", "task": "t.a", "upstream": "b"}]}, "'upstream' must be a list"),
        ({"name": "x", "nodes": [{"task": "t.a"}]}, "needs a string 'key'"),
        ({"name": "x", "deadline": "1h", "nodes": []}, "'deadline' must be a number of seconds"),
        ({"name": "x", "deadline": True, "nodes": []}, "'deadline' must be a number of seconds"),
        ({"name": "x", "on_deadline": 1, "nodes": []}, "'on_deadline' must be 'alert' or 'cancel'"),
        ({"name": "x", "nodes": [{"key": "a", "task": "t.a", "deadline": "5m"}]}, "'deadline' must be a number"),
        ({"name": "x", "nodes": [{"key": "a", "task": "t.a", "deadline": False}]}, "'deadline' must be a number"),
    ],
)
def test_bad_specs(spec: Any, fragment: str) -> None:
    with pytest.raises(SpecError) as info:
        dag_from_spec(spec)
    assert fragment in str(info.value)


def test_json_spec_refuses_nan() -> None:
    with pytest.raises(SpecError, match="not JSON"):
        parse_spec('{"name": "x", "nodes": [{"key": "a", "task": "t.a", "kwargs": {"x": NaN}}]}', fmt="json")


def test_yaml_nan_is_refused_by_validation() -> None:
    dag = dag_from_spec(parse_spec("name: x\nnodes:\n  - {key: a, task: t.a, kwargs: {x: .nan}}\n", fmt="yaml"))
    with pytest.raises(ValidationError, match="not JSON"):
        dag.validate(ok)


def test_unreadable_spec(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="cannot parse YAML"):
        load_spec(bad)


def test_the_branch_linter_stops_at_a_join_that_absorbs_the_skip() -> None:
    """Airflow's example_branch_operator: ``branching`` picks one of branch_a..d, each followed by
    ``follow_<x>``, all joined by ``join`` (none_failed_min_one_success), then more work below the
    join with the default all_success: no warning (the join runs whichever branch is taken, so
    nothing below it is skipped). A node that joins the branches itself with all_success still is."""
    dag = DAG("example_branch_operator")
    dag.task("run_this_first", "t.a")
    dag.task("branching", "t.a", upstream=["run_this_first"], branch=True)
    dag.task("join", "t.a", upstream=[f"follow_{x}" for x in "abcd"], trigger_rule="none_failed_min_one_success")
    for x in "abcd":
        dag.task(f"branch_{x}", "t.a", upstream=["branching"])
        dag.task(f"follow_{x}", "t.a", upstream=[f"branch_{x}"])
    dag.task("after_join", "t.a", upstream=["join"])
    dag.task("last", "t.a", upstream=["after_join", "join"])
    assert dag.lint() == []
    dag.task("bad_join", "t.a", upstream=["follow_a", "follow_b"])
    (warning,) = dag.lint()
    assert "'bad_join' joins branches of 'branching'" in warning


def test_a_dotted_key_is_refused_when_the_node_is_added() -> None:
    dag = DAG("groups")
    with pytest.raises(ValidationError, match=r"separates a task group's name from the key .*dag\.group"):
        dag.task("section_1.normal", "t.a")
    assert dag.nodes == {}
