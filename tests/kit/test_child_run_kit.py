"""Child runs (``DAG.run_dag``) under the test kit: the kit's reconciler passes run the child pass,
so a parent's child-run node starts its child, the kit's worker runs the child's tasks, and the
node ends with the child's leaf results."""

from __future__ import annotations

import pytest

from orchestrator import DAG, RunState
from orchestrator.testing import run_dag
from tests.kit.kit_tasks import CALLS  # noqa: F401  (registers the kit's tasks)

pytestmark = pytest.mark.postgres


def test_a_child_run_under_the_kit() -> None:
    child = DAG("sums-child")
    a = child.task("a", "kit.value", kwargs={"x": 2})
    b = child.task("b", "kit.value", kwargs={"x": 3})
    child.task("sum", "kit.total", upstream=[a, b])
    dag = DAG("sums-parent")
    dag.run_dag("kid", dag=child)
    dag.task("after", "kit.value", kwargs={"x": 1}, upstream=["kid"])
    result = run_dag(dag)
    assert result.state == RunState.SUCCEEDED, result.explain()
    assert result.results["kid"] == {"sum": 5.0} and result.results["after"] == 1
