"""The live tier: a real Celery worker in a thread (the app's broker: Redis here), on the kit's
database, without the ping check that breaks ``celery.contrib.testing``'s worker fixture."""

from __future__ import annotations

import os

import pytest

from orchestrator import DAG, TaskState
from orchestrator.testing.live import LiveWorker

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def test_a_real_worker_in_a_thread(orchestrator_worker: LiveWorker, redis_client: object) -> None:
    dag = DAG("live")
    a = dag.task("a", "kit.value", kwargs={"x": 2})
    b = dag.task("b", "kit.value", kwargs={"x": 5})
    dag.task("sum", "kit.total", upstream=[a, b])
    result = orchestrator_worker.run_dag(dag, timeout=60)
    assert result.state == "SUCCEEDED", result.explain()
    assert result.results["sum"] == 7.0
    # claimed by the worker thread of this process, not by the kit's in-process worker
    workers = {t.worker for t in result.tasks}
    assert all(w and w.endswith(f":{os.getpid()}") and not w.startswith("kit@") for w in workers), workers
    assert result.deliveries == []  # no message went through the kit's in-process queue
    assert result.states["sum"] == TaskState.SUCCEEDED
