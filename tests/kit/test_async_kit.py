"""The test kit (``run_dag``) runs ``async def`` bodies as a worker does: through Celery's tracer and
the base task, on the kit thread's kept loop (``orchestrator/runtime/aio.py``)."""

from __future__ import annotations

import pytest

import tasks.aio  # registers the async tasks on the project's app, the kit's
from orchestrator import DAG, RunState
from orchestrator.testing import run_dag

pytestmark = pytest.mark.postgres


def test_an_async_dag_runs_under_the_kit() -> None:
    dag = DAG("aio-kit")
    a = dag.task("a", tasks.aio.number.s(n=2))
    b = dag.task("b", "tasks.aio.number", kwargs={"n": 5})
    dag.task("total", "tasks.aio.add_up", upstream=[a, b], kwargs={"plus": 1})
    result = run_dag(dag)
    assert result.state == RunState.SUCCEEDED
    assert result.results["a"] == 2 and result.results["b"] == 5
    assert result.results["total"]["total"] == 8 and result.results["total"]["attempt"] == 1
