"""``orchestrator demo``: a small ETL DAG on the embedded default with an in-process worker."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from ..core import redact
from ..core.dag import DAG
from ..core.models import TaskView
from ..core.routing import default_queues
from ..core.states import RunState, TaskState

if TYPE_CHECKING:
    from ..engine.facade import RunHandle


def build_demo_dag(day: str = "2026-04-25", tenant: str = "demo") -> DAG:
    """extract_orders, extract_customers (flaky) -> clean_* -> aggregate -> load."""
    dag = DAG("demo_etl", tenant=tenant, params={"day": day})
    orders = dag.task("extract_orders", "tasks.etl.extract_orders", kwargs={"day": day})
    customers = dag.task(
        "extract_customers",
        "tasks.etl.extract_customers",
        kwargs={"day": day, "fail_first": 1},
        max_attempts=3,
        backoff={"base": 0.5, "cap": 2.0, "jitter": "full"},
    )
    c_orders = dag.task("clean_orders", "tasks.etl.clean_orders", upstream=[orders])
    c_customers = dag.task("clean_customers", "tasks.etl.clean_customers", upstream=[customers])
    agg = dag.task("aggregate", "tasks.etl.aggregate", upstream=[c_orders, c_customers])
    dag.task("load", "tasks.etl.load", upstream=[agg])
    return dag


def format_tasks(tasks: list[TaskView]) -> str:
    """A plain-text table: key, state, attempt, duration, error."""
    header = ("KEY", "STATE", "ATTEMPT", "DURATION", "ERROR")
    rows = [
        (
            t.key,
            t.state.value,
            str(t.attempt),
            f"{t.duration:.2f}s" if t.duration is not None else "-",
            (t.error or "")[:60] if t.state is not TaskState.SUCCEEDED else "",
        )
        for t in tasks
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows])


def progress_line(tasks: list[TaskView]) -> str:
    done = sum(t.state.terminal for t in tasks)
    parts = [f"{done}/{len(tasks)} done"]
    for state in (TaskState.RUNNING, TaskState.QUEUED, TaskState.RETRYING):
        keys = [t.key for t in tasks if t.state is state]
        if keys:
            parts.append(f"{state.value.lower()}: {', '.join(keys)}")
    return " | ".join(parts)


def follow(run: RunHandle, echo: Callable[[str], None], timeout: float, poll: float = 0.2) -> RunState:
    """Print a progress line whenever it changes until the run is final; return its state."""
    start = time.monotonic()
    last = ""
    while True:
        state = run.state
        line = progress_line(run.tasks())
        if line != last:
            echo(f"[{time.monotonic() - start:5.1f}s] {line}")
            last = line
        if state.terminal:
            return state
        if time.monotonic() - start > timeout:
            echo(f"gave up following after {timeout:.0f}s; the run goes on")
            return state
        time.sleep(poll)


def run_demo(echo: Callable[[str], None] = print, timeout: float = 120.0) -> int:
    """Run the demo DAG with an in-process worker and reconciler; 0 when the run SUCCEEDED."""
    from celery.contrib.testing.worker import start_worker

    from ..runtime.celery_app import get_app
    from ..runtime.process import current_orchestrator
    from ..runtime.worker import start_services, stop_services

    app = get_app()
    orc = current_orchestrator(app)
    # the flaky extract's first attempt fails on purpose; the table below reports it
    logging.getLogger("celery.app.trace").setLevel(logging.CRITICAL)
    echo(f"database: {redact.url(orc.database_url)}")
    echo(f"broker:   {redact.url(orc.settings.broker_url)}")
    with start_worker(
        app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="ERROR", shutdown_timeout=30
    ):
        # what `orchestrator worker` starts beside its pool: the registry and the reconciler
        start_services(app, "demo@in-process", default_queues(orc.settings.dedicated_tenants), 4)
        try:
            run = orc.submit(build_demo_dag())
            echo(f"run {run.id} submitted: demo_etl, 6 tasks")
            state = follow(run, echo, timeout)
        finally:
            stop_services()
    echo("")
    echo(format_tasks(run.tasks()))
    echo("")
    load = run.task("load")
    if load.result is not None:
        echo(f"loaded: {load.result}")
    echo(f"run {run.id}: {state.value}")
    return 0 if state is RunState.SUCCEEDED else 1


@click.command()
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to follow the run.")
def demo(timeout: float) -> None:
    """Run a small ETL DAG with an in-process worker on the embedded default."""
    sys.exit(run_demo(timeout=timeout))
