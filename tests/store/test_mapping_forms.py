"""Airflow's mapping forms in the store (``DAG.map``): a zip to the shortest, padded with
``zip_fill`` or strict; a mapping's ``[key, value]`` pairs (``items="pairs"``); ``None`` items
dropped (``skip_none``, over a list and over a mapped node); ``kwargs_from`` (Airflow's
``expand_kwargs``); and ``run_state="leaves"``. The workers' part is played by ``dynamic.drive``;
a transform runs in a real worker (``tests/integration/test_airflow_examples.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator import DAG, Orchestrator, ValidationError
from orchestrator.core.dag import MAP_MARK
from orchestrator.services.invariants import check_runs
from tests.store.dynamic import Fail, drive, orchestrator

pytestmark = pytest.mark.postgres


@pytest.fixture
def orc(pg_clean: str) -> Iterator[Orchestrator]:
    o = orchestrator(pg_clean)
    yield o
    o.store.attempts.hot.close()
    o.store.dispose()


def kwargs_of(d: Any, prefix: str) -> dict[str, dict[str, Any]]:
    """The keyword arguments each child of the map ``prefix`` ran with, by key."""
    return {k: kw for k, kw, _ in d.ran if k.startswith(prefix + "[")}


def test_a_zip_ends_with_its_shortest_argument_as_airflows_does(orc: Orchestrator) -> None:
    dag = DAG("zip-short")
    dag.task("ls", "t")
    dag.map("z", "t", over={"a": "ls", "b": [10, 20]}, combine="zip")
    d = drive(orc, dag, lambda k, kw, up: [1, 2, 3] if k == "ls" else kw)
    assert kwargs_of(d, "z") == {"z[0]": {"a": 1, "b": 10}, "z[1]": {"a": 2, "b": 20}}
    assert d.run_state() == "SUCCEEDED"
    assert orc.task(d.run_id, "z").map_counts["total"] == 2
    assert check_runs(orc.store, [d.run_id]) == []


@pytest.mark.parametrize("fill", [None, 0, "-"])
def test_zip_fill_pads_the_shorter_arguments_to_the_longest(orc: Orchestrator, fill: Any) -> None:
    dag = DAG("zip-fill")
    dag.task("ls", "t")
    dag.map("z", "t", over={"a": [7], "b": "ls", "c": ["x", "y"]}, zip_fill=fill)
    d = drive(orc, dag, lambda k, kw, up: [1, 2, 3] if k == "ls" else kw)
    assert kwargs_of(d, "z") == {
        "z[0]": {"a": 7, "b": 1, "c": "x"},
        "z[1]": {"a": fill, "b": 2, "c": "y"},
        "z[2]": {"a": fill, "b": 3, "c": fill},
    }
    assert d.run_state() == "SUCCEEDED" and check_runs(orc.store, [d.run_id]) == []


def test_items_pairs_maps_a_dict_to_key_value_pairs_keyed_by_its_keys(orc: Orchestrator) -> None:
    dag = DAG("pairs")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="pair", items="pairs")
    dag.map("v", "t", over="ls", kwarg="value")
    d = drive(orc, dag, lambda k, kw, up: {"eu": 3, "us": 5} if k == "ls" else kw)
    assert kwargs_of(d, "m") == {"m[eu]": {"pair": ["eu", 3]}, "m[us]": {"pair": ["us", 5]}}
    assert kwargs_of(d, "v") == {"v[eu]": {"value": 3}, "v[us]": {"value": 5}}  # the default: values
    assert d.run_state() == "SUCCEEDED"


def test_skip_none_drops_none_items_and_an_all_none_list_is_an_empty_map(orc: Orchestrator) -> None:
    dag = DAG("skip-none")
    dag.task("ls", "t")
    dag.map("m", "t", over="ls", kwarg="x", skip_none=True)
    dag.map("keep", "t", over="ls", kwarg="x")
    dag.map("e", "t", over=[None, None], kwarg="x", skip_none=True)
    d = drive(orc, dag, lambda k, kw, up: [1, None, 3] if k == "ls" else kw)
    assert kwargs_of(d, "m") == {"m[0]": {"x": 1}, "m[2]": {"x": 3}}  # keys stay the items' indexes
    assert len(kwargs_of(d, "keep")) == 3  # the default keeps them
    e = orc.task(d.run_id, "e")
    assert e.state.value == "SKIPPED" and e.skip_reason == "empty_map"
    assert d.run_state() == "SUCCEEDED"


def test_skip_none_over_a_mapped_node_maps_its_results_once_all_its_children_are_done(orc: Orchestrator) -> None:
    dag = DAG("skip-none-chained")
    dag.map("first", "t", over=[1, 2, 3, 4], kwarg="x")
    dag.map("second", "t", over="first", kwarg="y", skip_none=True)
    dag.task("join", "up", upstream=["second"])

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key.startswith("first["):
            return None if kw["x"] % 2 else kw["x"] * 10
        return kw.get("y", up)

    d = drive(orc, dag, body)
    order = [k for k, _, _ in d.ran]
    assert all(order.index(f"first[{i}]") < order.index("second[1]") for i in range(4)), order
    assert kwargs_of(d, "second") == {"second[1]": {"y": 20}, "second[3]": {"y": 40}}
    assert d.ran[-1] == ("join", {}, {"second": [20, 40]})
    assert d.run_state() == "SUCCEEDED" and check_runs(orc.store, [d.run_id]) == []


def test_kwargs_from_spreads_each_item_as_keyword_arguments(orc: Orchestrator) -> None:
    dag = DAG("kwargs-from")
    dag.task("ls", "t")
    dag.map("m", "t", kwargs_from="ls", kwargs={"c": 0})
    dag.map("lit", "t", kwargs_from=[{"a": 1}, {"a": 2, "c": 9}], kwargs={"c": 0})
    d = drive(orc, dag, lambda k, kw, up: [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}] if k == "ls" else kw)
    assert kwargs_of(d, "m") == {"m[0]": {"a": 1, "b": "x", "c": 0}, "m[1]": {"a": 2, "b": "y", "c": 0}}
    assert kwargs_of(d, "lit") == {"lit[0]": {"a": 1, "c": 0}, "lit[1]": {"a": 2, "c": 9}}
    assert d.run_state() == "SUCCEEDED"


def test_a_kwargs_from_item_that_is_no_mapping_fails_the_map_with_a_map_error(orc: Orchestrator) -> None:
    dag = DAG("kwargs-bad")
    dag.task("ls", "t")
    dag.map("m", "t", kwargs_from="ls")
    d = drive(orc, dag, lambda k, kw, up: [{"a": 1}, 5])
    m = orc.task(d.run_id, "m")
    assert m.state.value == "FAILED" and m.error is not None
    assert m.error.startswith("MapError: kwargs_from item 1 of ls is 5, not an object"), m.error
    assert d.run_state() == "FAILED"


def test_a_transform_is_left_to_the_worker_in_the_childs_kwargs(orc: Orchestrator) -> None:
    orc.registry.names = orc.registry.names | {"fns.double"}  # type: ignore[attr-defined]
    dag = DAG("transform")
    dag.map("m", "t", over=[1, 2], kwarg="x", transform="fns.double")
    d = drive(orc, dag, lambda k, kw, up: None)
    assert kwargs_of(d, "m")["m[0]"] == {"x": 1, MAP_MARK: {"kwarg": "x", "transform": "fns.double"}}


def test_the_forms_are_refused_where_they_mean_nothing() -> None:
    dag = DAG("bad")
    dag.task("ls", "t")
    cases = [
        (dict(over="ls", kwarg="x", zip_fill=0), "zip_fill pads a zip of several"),
        (dict(over={"a": "ls", "b": [1]}, combine="product", zip_fill=0), "zip_fill pads a zip of several"),
        (dict(over="ls", kwarg="x", items="keys"), "items must be one of values, pairs"),
        (dict(over={"a": "ls", "b": [1]}, combine="zip", transform="t"), "transform applies to one mapped argument"),
        (dict(kwargs_from=[{"a": 1}, 3]), "kwargs_from item 1 is 3"),
        (dict(over={"a": "ls", "b": [1]}, combine="zipped"), "combine= one of zip, zip_strict, product"),
    ]
    for i, (options, message) in enumerate(cases):
        dag.map(f"m{i}", "t", **options)  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match=message):
            dag.validate()
        del dag.nodes[f"m{i}"]
    with pytest.raises(ValidationError, match="kwargs_from maps keyword arguments by itself"):
        dag.map("k", "t", over="ls", kwarg="x", kwargs_from="ls")
    with pytest.raises(ValidationError, match="transform must be a registered Celery task"):
        dag.map("k", "t", over="ls", kwarg="x", transform=len)
    with pytest.raises(ValidationError, match="run_state must be one of all, leaves"):
        DAG("bad", run_state="last")


def test_the_forms_round_trip_through_the_spec_format() -> None:
    from orchestrator.core.dag import dag_from_spec

    dag = DAG("spec", run_state="leaves")
    dag.task("ls", "t")
    dag.map("a", "t", over={"x": "ls", "y": [1]}, zip_fill=None)
    dag.map("b", "t", over="ls", kwarg="p", items="pairs", skip_none=True, transform="t")
    dag.map("c", "t", kwargs_from="ls")
    again = dag_from_spec(dag.to_spec())
    assert again.to_spec() == dag.to_spec()
    assert again.nodes["a"].map is not None and again.nodes["a"].map.zip_fill is None
    assert dag.to_spec()["nodes"][3]["map"] == {"kwargs_from": "ls"}


def watcher(run_state: str) -> DAG:
    """Airflow's watcher pattern's inverse: ``work`` fails, ``cleanup`` (all_done) runs anyway and
    is the only leaf; a teardown leaf stands for the tasks above it."""
    dag = DAG("leaves", run_state=run_state)
    dag.task("setup", "t", setup=True)
    dag.task("work", "t", upstream=["setup"])
    dag.task("cleanup", "t", upstream=["work"], trigger_rule="all_done")
    dag.task("teardown", "t", upstream=["cleanup"], teardown=True)
    return dag


@pytest.mark.parametrize(("run_state", "expected"), [("all", "FAILED"), ("leaves", "SUCCEEDED")])
def test_run_state_leaves_lets_the_leaves_decide_the_run(orc: Orchestrator, run_state: str, expected: str) -> None:
    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "work":
            raise Fail("boom")
        return None

    d = drive(orc, watcher(run_state), body)
    assert d.states() == {"setup": "SUCCEEDED", "work": "FAILED", "cleanup": "SUCCEEDED", "teardown": "SUCCEEDED"}
    assert d.run_state() == expected


def test_under_leaves_a_failed_leaf_or_leaf_map_child_fails_the_run(orc: Orchestrator) -> None:
    dag = DAG("leaves-map", run_state="leaves")
    dag.task("ls", "t")
    dag.map("mid", "t", over="ls", kwarg="x")
    dag.task("after", "t", upstream=["mid"], trigger_rule="all_done")
    dag.map("leaf", "t", over="ls", kwarg="x")

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        if key == "ls":
            return [1, 2]
        if key in ("mid[0]", "leaf[1]"):
            raise Fail("boom")
        return None

    d = drive(orc, dag, body)
    assert d.states()["after"] == "SUCCEEDED"
    assert d.run_state() == "FAILED"  # leaf[1], not mid[0]
    assert orc.task(d.run_id, "mid[0]").state.value == "FAILED"
    assert dag.deciders() == {"after", "leaf"}
    assert watcher("leaves").deciders() == {"cleanup"}


def test_a_skip_none_map_over_a_cleared_map_maps_its_new_results(orc: Orchestrator) -> None:
    dag = DAG("skip-none-clear")
    dag.map("first", "t", over=[1, 2, 3], kwarg="x")
    dag.map("second", "t", over="first", kwarg="y", skip_none=True)
    calls: dict[str, int] = {}

    def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> Any:
        calls[key] = calls.get(key, 0) + 1
        if key.startswith("first["):
            # the first time only item 2 is kept; after the clear every item is
            return kw["x"] if calls[key] > 1 or kw["x"] == 2 else None
        return kw["y"]

    d = drive(orc, dag, body)
    assert kwargs_of(d, "second") == {"second[1]": {"y": 2}}
    orc.clear(d.run_id, "first", downstream=True)
    again = drive(orc, dag, body, run_id=d.run_id)
    assert {k: kw for k, kw, _ in again.ran if k.startswith("second[")} == {
        "second[0]": {"y": 1}, "second[1]": {"y": 2}, "second[2]": {"y": 3},
    }  # fmt: skip
    assert again.run_state() == "SUCCEEDED"
    assert check_runs(orc.store, [d.run_id]) == []
