"""Edge labels (``DAG.label``, Airflow's ``Label``) and task groups folded in the drawing
(issue 33): a label names an existing edge, rides the spec format and the run's DAG snapshot, and
is written on its arrow (SVG, dot, Mermaid); a task group is one box counting its tasks by state
(Airflow's collapsed group) unless opened, on the run page (a click: ``?part=dag&expand=``), in
``/api/runs/RUN_ID/graph`` and ``/changes`` (``expand=``) and ``orchestrator runs graph``
(``--expand``, ``--open``). The web part runs on the Postgres test database."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest
from click.testing import CliRunner

from orchestrator import DAG, SpecError, ValidationError
from orchestrator.cli import app as cli
from orchestrator.cli import base as cli_base
from orchestrator.core import graph as drawing
from orchestrator.core.dag import dag_from_spec
from orchestrator.core.dag.labels import edge_labels
from orchestrator.core.graph.fold import closed_group, fold
from tests.store.dynamic import Fail, drive
from tests.unit.test_web import TOKEN, WebCase, bearer


def airflow_task_group() -> DAG:
    """Airflow's ``example_task_group``, with two labels: ``start >> Label("go") >> section_1``
    and ``section_2 >> Label("done") >> end``."""
    dag = DAG("example_task_group")
    start = dag.task("start", "t.ok")
    with dag.group("section_1", upstream=[start]) as section_1:
        task_1 = dag.task("task_1", "t.ok")
        dag.task("task_2", "t.ok", upstream=[task_1])
        dag.task("task_3", "t.ok", upstream=[task_1])
    with dag.group("section_2", upstream=[section_1]) as section_2:
        dag.task("task_1", "t.ok")
        with dag.group("inner_section_2"):
            task_2 = dag.task("task_2", "t.ok")
            task_3 = dag.task("task_3", "t.ok")
            dag.task("task_4", "t.ok", upstream=[task_2, task_3])
    end = dag.task("end", "t.ok", upstream=[section_2])
    dag.label(start, section_1, "go")
    dag.label(section_2, end, "done")
    return dag


def edges_of(dag: DAG) -> list[tuple[str, str]]:
    return [(p, k) for k, n in dag.nodes.items() for p in n.upstream]


def test_a_label_names_existing_edges_and_a_group_stands_for_its_leaves_or_roots() -> None:
    dag = airflow_task_group()
    assert dag.labels == {
        ("start", "section_1.task_1"): "go",
        ("section_2.task_1", "end"): "done",
        ("section_2.inner_section_2.task_4", "end"): "done",
    }
    with dag.group("section_3", upstream=[dag.nodes["end"]]):
        dag.task("a", "t.ok")
        dag.task("b", "t.ok", upstream=["a"])
        dag.label("a", "b", "then")  # bare keys resolve in the open group
    assert dag.labels[("section_3.a", "section_3.b")] == "then"


@pytest.mark.parametrize(
    ("parent", "child", "text", "message"),
    [
        ("start", "end", "x", "no edge from start to end to label"),
        ("start", "nowhere", "x", "unknown node 'nowhere'"),
        ("start", "section_1.task_1", "", "an edge label must not be empty"),
        ("start", "section_1.task_1", "a\nb", "control character"),
        ("start", "section_1.task_1", "x" * 101, "over 100"),
    ],
)
def test_a_bad_label_is_refused(parent: str, child: str, text: str, message: str) -> None:
    dag = airflow_task_group()
    with pytest.raises(ValidationError, match=message):
        dag.label(parent, child, text)


def test_labels_round_trip_through_the_spec_format() -> None:
    dag = airflow_task_group()
    spec = dag.to_spec()
    assert {"from": "start", "to": "section_1.task_1", "label": "go"} in spec["labels"]
    again = dag_from_spec(json.loads(json.dumps(spec)))
    assert again.labels == dag.labels and again.to_spec() == spec
    assert edge_labels(spec) == dag.labels
    assert "labels" not in DAG("plain").to_spec()  # a DAG without labels: its snapshot as before
    for bad in (
        {"x": 1},
        [{"from": "start", "to": "section_1.task_1"}],
        [{"from": "start", "to": "ghost", "label": "x"}],
    ):
        with pytest.raises(SpecError):
            dag_from_spec({**spec, "labels": bad})
    with pytest.raises(ValidationError, match="no edge"):
        dag_from_spec({**spec, "labels": [{"from": "start", "to": "end", "label": "x"}]})


def test_a_closed_group_is_one_vertex_and_an_open_one_shows_its_inner_groups_folded() -> None:
    dag = airflow_task_group()
    assert closed_group("section_2.inner_section_2.task_2", ()) == "section_2"
    assert closed_group("section_2.inner_section_2.task_2", ("section_2",)) == "section_2.inner_section_2"
    assert closed_group("section_1.each[3]", ("section_1",)) is None
    assert closed_group("start", ()) is None
    folded = fold(list(dag.nodes), edges_of(dag), ())
    assert folded.vertices == ["end", "section_1.", "section_2.", "start"]
    assert sorted(folded.edges) == [("section_1.", "section_2."), ("section_2.", "end"), ("start", "section_1.")]
    assert fold(list(dag.nodes), edges_of(dag), None).vertices == sorted(dag.nodes)


def picture(dag: DAG, open_groups: Any, states: dict[str, str] | None = None) -> drawing.Graph:
    tasks = [drawing.TaskInfo(k, "t.ok", (states or {}).get(k, "SUCCEEDED")) for k in dag.nodes]
    return drawing.layout(tasks, edges_of(dag), open_groups=open_groups, labels=dag.labels)


def test_a_folded_group_is_one_box_counting_its_tasks_and_labels_ride_the_arrows() -> None:
    dag = airflow_task_group()
    graph = picture(dag, (), {"section_2.task_1": "FAILED"})
    boxes = {b.id: b for b in graph.boxes}
    assert sorted(boxes) == ["group-section_1", "group-section_2", "task-0-end", "task-3-start"]
    s2 = boxes["group-section_2"]
    assert s2.kind == "group" and s2.collapsed and s2.label == "section_2" and len(s2.keys) == 4
    assert s2.counts == {"FAILED": 1, "SUCCEEDED": 3} and s2.state == "MIXED"
    assert drawing.counted(s2) == "group section_2, 4 tasks: 3 SUCCEEDED, 1 FAILED"
    assert graph.labels == {("group-section_2", "task-0-end"): "done", ("task-3-start", "group-section_1"): "go"}
    svg = drawing.to_svg(graph)
    assert svg.count('class="node collapsed group"') == 2 and 'data-group="section_2"' in svg
    assert '<text class="elabel" data-from="task-3-start" data-to="group-section_1"' in svg and ">go<" in svg
    assert '"group-section_2" -> "task-0-end" [label="done"]' in drawing.to_dot(graph)
    assert '-- "go" -->' in drawing.to_mermaid(graph)
    # section_2 opened: its inner group stays folded, the ids of the other groups unchanged
    opened = picture(dag, ("section_2",))
    ids = sorted(b.id for b in opened.boxes)
    assert "group-section_1" in ids and "group-section_2.inner_section_2" in ids
    assert [b.label for b in opened.boxes if b.kind == "task"].count("section_2.task_1") == 1
    # every group open: every task a box, each labelled edge its own arrow
    every = picture(dag, None)
    assert len(every.boxes) == len(dag.nodes) and len(every.labels) == 3


def test_a_folded_group_counts_a_maps_children_and_a_group_reached_around_folds() -> None:
    dag = DAG("m")
    start = dag.task("start", "t.ok")
    with dag.group("g", upstream=[start]):
        ls = dag.task("ls", "t.ok")
        dag.map("each", "t.ok", over=ls, kwarg="x")
    tasks = [
        drawing.TaskInfo("start", "t.ok", "SUCCEEDED"),
        drawing.TaskInfo("g.ls", "t.ok", "SUCCEEDED"),
        drawing.TaskInfo("g.each", "t.ok", "MAPPED", is_map=True),
        *[drawing.TaskInfo(f"g.each[{i}]", "t.ok", "SUCCEEDED", map_parent="g.each") for i in range(5)],
    ]
    box = next(b for b in drawing.layout(tasks, edges_of(dag), open_groups=()).boxes if b.kind == "group")
    assert box.counts == {"SUCCEEDED": 6}  # ls and the map's 5 children
    # a group whose tasks reach each other through a task outside it folds into a cycle: drawn anyway
    keys = ["g.a", "x", "g.b"]
    cyc = drawing.structure(keys, [("g.a", "x"), ("x", "g.b")], open_groups=())
    assert sorted(b[0] for b in cyc.boxes) == ["group-g", "task-1-x"] and len(cyc.arrows) == 2


class TestGroupsOnTheRunPage(WebCase):
    auth = TOKEN

    def setUp(self) -> None:
        super().setUp()
        self.session = {"Cookie": self.log_in(TOKEN)}

        def body(key: str, kw: dict[str, Any], up: dict[str, Any]) -> None:
            if key == "section_2.task_1":
                raise Fail("boom")

        self.run_id = drive(self.orc, airflow_task_group(), body).run_id

    def test_the_page_folds_each_group_and_opens_one_on_request(self) -> None:
        html = self.get(f"/runs/{self.run_id}").body.decode()
        assert html.count('class="node collapsed group"') == 2 and 'id="fold-groups" hidden' in html
        assert 'data-group="section_1"' in html and "\u25b8 section_1" in html
        assert '<text class="elabel"' in html and ">go<" in html and ">done<" in html
        part = self.get(f"/runs/{self.run_id}?part=dag&expand=section_2").body.decode()
        assert 'data-group="section_2.inner_section_2"' in part and 'data-key="section_2.task_1"' in part
        assert 'data-group="section_1"' in part and 'data-group="section_2"' not in part
        every = self.get(f"/runs/{self.run_id}?part=dag&expand=*").body.decode()
        assert "collapsed" not in every and every.count('class="node"') == 9
        assert self.get(f"/runs/{self.run_id}?part=dag&expand=a..b").code == 400
        script = self.get("/static/run.js").body.decode()
        assert "g.node.group" in script and "&expand=" in script

    def test_the_api_draws_and_polls_the_drawing_the_page_shows(self) -> None:
        dot = self.get(f"/api/runs/{self.run_id}/graph?format=dot", **bearer(TOKEN)).body.decode()
        assert '"group-section_1"' in dot and '[label="go"]' in dot
        dot = self.get(f"/api/runs/{self.run_id}/graph?format=dot&expand=*", **bearer(TOKEN)).body.decode()
        assert "group-" not in dot and dot.count('[label="done"]') == 2
        changes = json.loads(self.get(f"/api/runs/{self.run_id}/changes?after=0", **bearer(TOKEN)).body)
        assert changes["tasks"]["section_1.task_2"]["box"] == "group-section_1"
        s2 = changes["boxes"]["group-section_2"]
        assert s2["counts"] == {"FAILED": 1, "SUCCEEDED": 3} and s2["title"].startswith("group section_2, 4 tasks")
        opened = json.loads(self.get(f"/api/runs/{self.run_id}/changes?after=0&expand=section_2", **bearer(TOKEN)).body)
        assert opened["tasks"]["section_2.inner_section_2.task_2"]["box"] == "group-section_2.inner_section_2"
        assert opened["tasks"]["section_2.task_1"]["box"].startswith("task-")

    def test_the_command_line_draws_groups_folded_unless_told(self) -> None:
        with mock.patch.object(cli_base, "_ready_store", lambda: self.orc):
            folded = CliRunner().invoke(cli.main, ["graph", self.run_id, "--format", "mermaid"])
            opened = CliRunner().invoke(cli.main, ["graph", self.run_id, "--format", "mermaid", "--open", "section_1"])
            every = CliRunner().invoke(cli.main, ["graph", self.run_id, "--format", "mermaid", "--expand"])
        assert folded.exit_code == 0, folded.output
        assert "group section_1 (3 tasks)" in folded.stdout and '-- "go" -->' in folded.stdout
        assert "group section_1" not in opened.stdout and "section_1.task_2" in opened.stdout
        assert "group section_2 (4 tasks)" in opened.stdout
        assert "group " not in every.stdout and "section_2.inner_section_2.task_4" in every.stdout
