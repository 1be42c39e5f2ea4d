"""Child runs' lineage where people look (issue 34): the run page links a parent to its child
runs and a child to its parent, ``orchestrator status`` (text and ``--json``) names both, and
``explain`` says ``waiting on child run ID``. On the Postgres test database, through Tornado's
test client and click's runner."""

from __future__ import annotations

import json

from click.testing import CliRunner

from orchestrator import DAG
from orchestrator.cli import base, main
from tests.unit.test_web import TOKEN, WebCase, bearer, finish


def parent() -> DAG:
    child = DAG("etl")
    child.task("x", "t.ok")
    dag = DAG("nightly")
    dag.task("a", "t.ok")
    dag.run_dag("kid", dag=child, upstream=["a"])
    return dag


class TestChildRunLineage(WebCase):
    auth = TOKEN

    def setUp(self) -> None:
        super().setUp()
        self.session = {"Cookie": self.log_in(TOKEN)}

    def started(self) -> tuple[str, str]:
        run = self.orc.submit(parent())
        finish(self.orc)  # a succeeds: kid waits
        assert self.orc.children.tick() == 1  # the child pass starts kid's child
        (kid,) = self.orc.children.lineage(run.id)["children"]
        return run.id, kid["run_id"]

    def test_the_run_page_links_each_way(self) -> None:
        run_id, child_id = self.started()
        html = self.get(f"/runs/{run_id}").body.decode()
        assert f'class="child-run" href="/runs/{child_id}"' in html and "task kid, attempt 1, running" in html
        html = self.get(f"/runs/{child_id}").body.decode()
        assert f'id="parent-run" href="/runs/{run_id}"' in html and "its task kid, attempt 1" in html
        why = self.orc.explain(run_id, "kid")[0].reasons[0]
        assert why.detail.startswith(f"waiting on child run {child_id}") and why.data == {"child_run": child_id}
        assert self.get(f"/api/runs/{run_id}", **bearer(TOKEN)).code == 200

    def test_status_names_the_parent_and_the_children(self) -> None:
        run_id, child_id = self.started()
        saved = base._ready_store
        base._ready_store = lambda: self.orc  # type: ignore[assignment]
        try:
            runner = CliRunner()
            out = runner.invoke(main, ["status", run_id])
            assert out.exit_code == 0, out.output
            assert f"child run {child_id}  of task kid (attempt 1)  RUNNING" in out.output
            out = runner.invoke(main, ["status", child_id])
            assert f"parent run {run_id}  task kid (attempt 1)" in out.output
            doc = json.loads(runner.invoke(main, ["status", child_id, "--json"]).output)
            assert doc["lineage"]["parent"] == {"run_id": run_id, "key": "kid", "attempt": 1}
        finally:
            base._ready_store = saved  # type: ignore[assignment]
