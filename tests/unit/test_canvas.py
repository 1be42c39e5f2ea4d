"""Celery canvases read as DAGs (``core/dag/canvas.py``): keys, edges and the placeholders that
pass results as Celery does, for every shape Celery builds; options refused as a node refuses
them; the placeholders' checks; the script's own tasks named after its module."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain, chord, group

from orchestrator.core.dag import DAG, dag_from_spec
from orchestrator.core.dag.passing import placeholder, resolve
from orchestrator.core.errors import ValidationError

app = Celery("canvas-unit", set_as_current=False)


@app.task(name="t.a")
def a(*args: Any, **kwargs: Any) -> None: ...


@app.task(name="t.b")
def b(*args: Any, **kwargs: Any) -> None: ...


@app.task(name="t.err")
def err(*args: Any) -> None: ...


def shape(dag: DAG) -> dict[str, tuple[Any, ...]]:
    return {k: (n.task, tuple(n.args), tuple(n.upstream), n.trigger_rule.value) for k, n in dag.nodes.items()}


def test_a_chain_passes_each_result_as_the_next_steps_first_argument_unless_immutable() -> None:
    dag = DAG.from_canvas(chain(a.s(1), b.s(2), b.si(3), a.s()), name="c")
    assert shape(dag) == {
        "a": ("t.a", (1,), (), "all_success"),
        "b": ("t.b", ({"__orc_result__": "a"}, 2), ("a",), "all_success"),
        "b-2": ("t.b", (3,), ("b",), "all_success"),
        "a-2": ("t.a", ({"__orc_result__": "b-2"},), ("b-2",), "all_success"),
    }


def test_a_chord_body_gets_its_headers_results_in_order_and_groups_of_groups_flatten() -> None:
    dag = DAG.from_canvas(chain(a.s(), chord(group(group(b.s(i) for i in range(2)), b.s(9)), a.s())))
    assert dag.name == "chain-a"
    assert [k for k in dag.nodes] == ["a", "b[0]", "b[1]", "b[2]", "a-2"]
    assert dag.nodes["b[2]"].args == ({"__orc_result__": "a"}, 9)
    assert dag.nodes["a-2"].args == ({"__orc_results__": ["b[0]", "b[1]", "b[2]"]},)
    assert dag.nodes["a-2"].upstream == ("b[0]", "b[1]", "b[2]")


def test_a_step_after_a_group_gets_the_list_and_a_group_start_gets_nothing() -> None:
    # Celery turns chain(group, task) into a chord: the task gets the list
    dag = DAG.from_canvas(group(a.s(1), a.s(2)) | b.s())
    assert dag.nodes["a[0]"].args == (1,) and dag.nodes["a[0]"].upstream == ()
    assert dag.nodes["b"].args == ({"__orc_results__": ["a[0]", "a[1]"]},)


def test_options_set_on_a_part_or_handed_down_from_its_container() -> None:
    sig = chain(a.s().set(queue="io", priority="high"), b.s().set(soft_time_limit=5, time_limit=10)).set(queue="cpu")
    dag = DAG.from_canvas(sig)
    assert (dag.nodes["a"].queue, dag.nodes["a"].priority.value) == ("io", "high")  # type: ignore[union-attr]
    assert (dag.nodes["b"].queue, dag.nodes["b"].soft_time_limit, dag.nodes["b"].time_limit) == ("cpu", 5, 10)


@pytest.mark.parametrize("option", ["countdown", "eta", "expires"])
def test_an_option_that_breaks_the_promise_is_refused_on_a_part_and_on_a_container(option: str) -> None:
    value: Any = "2030-01-01T00:00:00" if option == "eta" else 5
    with pytest.raises(ValidationError, match=option):
        DAG.from_canvas(chain(a.s(), b.s().set(**{option: value})))
    with pytest.raises(ValidationError, match=option):
        DAG.from_canvas(chain(a.s(), b.s()).set(**{option: value}))


def test_link_error_goes_where_celery_links_it() -> None:
    # on a chain: every part; on a chord: its body only (Celery's default); on a group: each part
    dag = DAG.from_canvas(chain(a.s(), chord([b.s(), b.s()], a.s())).on_error(err.s("x")))
    callbacks = {k: n for k, n in dag.nodes.items() if n.task == "t.err"}
    assert sorted(callbacks) == ["err-a", "err-a-2"]
    assert callbacks["err-a"].args == ({"__orc_error__": "a", "pass": True}, "x")
    assert callbacks["err-a"].upstream == ("a",) and callbacks["err-a"].trigger_rule.value == "one_failed"
    grouped = DAG.from_canvas(group(a.s(), a.s()).on_error(err.si()))
    assert sorted(k for k in grouped.nodes if k.startswith("err")) == ["err-a[0]", "err-a[1]"]
    assert grouped.nodes["err-a[0]"].args == ({"__orc_error__": "a[0]", "pass": False},)


def test_link_adds_a_callback_that_gets_the_result() -> None:
    sig = a.s(1)
    sig.link(b.s(2))
    dag = DAG.from_canvas(sig)
    assert shape(dag)["b"] == ("t.b", ({"__orc_result__": "a"}, 2), ("a",), "all_success")


def test_shapes_that_cannot_be_mirrored_are_refused_clearly() -> None:
    with pytest.raises(ValidationError, match="empty group"):
        DAG.from_canvas(group([]))
    with pytest.raises(ValidationError, match="nested list"):
        DAG.from_canvas(chord([chain(a.s(), group(b.s(), b.s()))], a.s()))
    with pytest.raises(ValidationError, match="canvas must be a Celery signature"):
        DAG.from_canvas({"not": "a signature"})


def test_the_placeholders_survive_the_spec_and_are_checked() -> None:
    dag = DAG.from_canvas(chain(a.s(), chord([b.s(), b.s()], a.s())), name="spec")
    again = dag_from_spec(dag.to_spec())
    assert {k: n.args for k, n in again.nodes.items()} == {k: n.args for k, n in dag.nodes.items()}
    bad = DAG("bad")
    bad.task("x", "t.a")
    bad.task("y", "t.b", upstream=["x"], args=[{"__orc_result__": "z"}])
    with pytest.raises(ValidationError, match="not a parent"):
        bad.validate()
    late = DAG("late")
    late.task("x", "t.a", args=[1, {"__orc_results__": []}])
    with pytest.raises(ValidationError, match="reserved"):
        late.validate()


def test_resolve_replaces_the_placeholder_from_the_claims_results() -> None:
    assert resolve([{"__orc_result__": "p"}, 2], {"p": [1]}) == [[1], 2]
    assert resolve([{"__orc_results__": ["q", "p"]}], {"p": 1, "q": 2}) == [[2, 1]]
    assert placeholder([{"__orc_result__": "p", "other": 1}]) is None
    assert resolve([{"__orc_error__": "p", "pass": True}], {}) == [{"__orc_error__": "p", "pass": True}]


def test_an_index_key_may_not_shadow_a_maps_child() -> None:
    dag = DAG("m")
    dag.task("src", "t.a")
    dag.map("fan", "t.b", over="src", kwarg="item")
    dag.task("fan[0]", "t.a")
    with pytest.raises(ValidationError, match="child of the mapped node"):
        dag.validate()


def test_tasks_defined_in_the_script_being_run_take_its_modules_name(tmp_path: Path) -> None:
    (tmp_path / "myflow.py").write_text(
        textwrap.dedent(
            """
            from orchestrator.celery_app import get_app
            app = get_app()

            @app.task
            def extract(day):
                return day

            if __name__ == "__main__":
                print(extract.name)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path.cwd()}"}
    listed = {**env, "ORCHESTRATOR_TASK_MODULES": "tasks.probes,myflow"}
    out = subprocess.run([sys.executable, "myflow.py"], cwd=tmp_path, env=listed, capture_output=True, text=True)
    assert out.stdout.strip() == "myflow.extract", out.stderr
    unlisted = {**env, "ORCHESTRATOR_TASK_MODULES": "tasks.probes"}
    out = subprocess.run([sys.executable, "myflow.py"], cwd=tmp_path, env=unlisted, capture_output=True, text=True)
    assert out.stdout.strip() == "orchestrator.extract", out.stderr
