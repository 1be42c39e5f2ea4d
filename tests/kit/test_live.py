"""The live tier: a real Celery worker in a thread (the app's broker: Redis here), on the kit's
database, without the ping check that breaks ``celery.contrib.testing``'s worker fixture.

The app here has a broker database of its own: the integration tier's session worker consumes
the suite's broker (``tests/conftest.py``) and would take these messages for its own database."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from orchestrator import DAG, Settings, TaskState
from orchestrator.runtime.celery_app import create_app
from orchestrator.testing import Kit
from orchestrator.testing.live import LiveWorker
from tests.conftest import REDIS_BASE
from tests.kit import kit_tasks

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def live_app() -> Any:
    """The kit's tasks on an app whose broker is a Redis database no other worker consumes."""
    settings = dataclasses.replace(Settings.from_env(), broker_url=f"{REDIS_BASE}/14")
    app = create_app(settings, main="kit-live")
    for task in (kit_tasks.value, kit_tasks.total):
        app.task(name=task.name)(task.run)
    return app


def test_a_real_worker_in_a_thread(orchestrator: Kit, redis_client: object) -> None:
    dag = DAG("live")
    a = dag.task("a", "kit.value", kwargs={"x": 2})
    b = dag.task("b", "kit.value", kwargs={"x": 5})
    dag.task("sum", "kit.total", upstream=[a, b])
    with LiveWorker(orchestrator, app=live_app()) as live:
        result = live.run_dag(dag, timeout=60)
    assert result.state == "SUCCEEDED", result.explain()
    assert result.results["sum"] == 7.0
    # claimed by the worker thread of this process, not by the kit's in-process worker
    workers = {t.worker for t in result.tasks}
    assert all(w and w.endswith(f":{os.getpid()}") and not w.startswith("kit@") for w in workers), workers
    assert result.deliveries == []  # no message went through the kit's in-process queue
    assert result.states["sum"] == TaskState.SUCCEEDED
