"""One trace per run, end to end: a DAG submitted inside a client span runs on a real prefork
worker traced as a user traces one (``tests/integration/otel_worker.py``: OpenTelemetry's
Celery instrumentation and Sentry's Celery integration, each writing to a file), and every
attempt — one re-published by the worker's reconciler, one retried — is a span in the client's
trace, descending from the client's span; the ledger exporter adds the run's ledger to that
trace; Sentry's worker-side transactions continue the submitter's Sentry trace; and a run
submitted without any of it runs as before.

The test runs on a database of its own (``orchestrator_trace``) and a queue no other test's
worker consumes, so its worker holds the reconciler's duty and runs every attempt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from orchestrator import DAG, Orchestrator, RunState
from orchestrator.core.config import Settings
from orchestrator.core.models import Dispatch
from orchestrator.core.protocol import FencingToken
from orchestrator.runtime.celery_app import create_app
from orchestrator.runtime.tracing import export_run_ledger
from tests import conftest as shared
from tests.conftest import DATA_DIR, IT_BROKER_URL, ensure_database, reset_schema
from tests.integration.conftest import ROOT, stop_process

pytestmark = pytest.mark.integration
P = "tasks.probes."
QUEUE = f"orchestrator.test.trace{os.environ.get('ORCHESTRATOR_TEST_DB_SUFFIX', '')}"


def _hex(n: int, width: int) -> str:
    return f"{n:0{width}x}"


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _until(what: str, found: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll ``found`` until it returns something truthy (a condition, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        got = found()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout}s")
        time.sleep(0.1)


class Dropping:
    """The client's publisher, losing the first message of ``key``: its dispatch stays QUEUED
    and the worker's reconciler re-publishes it after the dispatch timeout."""

    def __init__(self, inner: Any, key: str) -> None:
        self.inner, self.key, self.dropped = inner, key, False

    def publish(self, dispatches: list[Dispatch]) -> int:
        keep = [d for d in dispatches if self.dropped or d.key != self.key]
        self.dropped = self.dropped or len(keep) < len(dispatches)
        return self.inner.publish(keep) + len(dispatches) - len(keep)

    def revoke(self, task_ids: list[str]) -> None:
        self.inner.revoke(task_ids)


class Traced:
    """What the module shares: the client, its in-memory spans, the worker's files."""

    def __init__(
        self,
        orc: Orchestrator,
        provider: Any,
        exporter: Any,
        spans: Path,
        sentry: Path,
        worker: subprocess.Popen[bytes],
    ) -> None:
        self.orc, self.provider, self.exporter, self.spans, self.sentry = orc, provider, exporter, spans, sentry
        self.worker = worker

    def worker_spans(self) -> list[dict[str, Any]]:
        return _lines(self.spans)

    def client_spans(self) -> list[dict[str, Any]]:
        """The client's ended spans in the worker file's shape."""
        out = []
        for s in self.exporter.get_finished_spans():
            out.append(
                {
                    "name": s.name,
                    "kind": s.kind.name,
                    "trace_id": _hex(s.context.trace_id, 32),
                    "span_id": _hex(s.context.span_id, 16),
                    "parent_id": _hex(s.parent.span_id, 16) if s.parent is not None else None,
                    "attributes": dict(s.attributes),
                    "events": [e.name for e in s.events],
                    "pid": os.getpid(),
                }
            )
        return out


@pytest.fixture(scope="module")
def traced(redis_client: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    url = ensure_database(shared.test_database("orchestrator_trace"))
    reset_schema(url)
    tmp = tmp_path_factory.mktemp("trace")
    spans, sentry, log = tmp / "spans.jsonl", tmp / "sentry.jsonl", Path(DATA_DIR) / "trace-worker.log"
    env = {
        **os.environ,
        "ORCHESTRATOR_DATABASE_URL": url,
        "ORCHESTRATOR_BROKER_URL": IT_BROKER_URL,
        "ORCHESTRATOR_DISPATCH_TIMEOUT": "1.5",
        "ORC_TEST_SPANS": str(spans),
        "ORC_TEST_SENTRY": str(sentry),
    }
    app = create_app(Settings.from_env(env))
    app.loader.import_default_modules()  # the tasks registered, as a submitter that imports them has them
    orc = Orchestrator(app=app)
    # the client: OpenTelemetry's Celery instrumentation on a provider of its own, in memory
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    CeleryInstrumentor().instrument(tracer_provider=provider)
    cmd = [sys.executable, "-m", "celery", "-A", "tests.integration.otel_worker", "worker", "--pool", "prefork",
           "-c", "2", "-Q", QUEUE, "-n", "trace@%h", "--without-gossip", "--without-mingle"]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _until("the traced worker's registry row", lambda: proc.poll() is None and orc.store.workers.live(), 60)
        yield Traced(orc, provider, exporter, spans, sentry, proc)
    finally:
        CeleryInstrumentor().uninstrument()
        stop_process(proc)
        orc.store.engine.dispose()


def _tree(spans: list[dict[str, Any]], root: str) -> str:
    """The spans under ``root`` drawn as a tree (printed by the test: ``pytest -s``)."""
    children: dict[str | None, list[dict[str, Any]]] = {}
    for s in spans:
        children.setdefault(s["parent_id"], []).append(s)
    lines: list[str] = []

    def draw(span_id: str, depth: int) -> None:
        for s in sorted(children.get(span_id, []), key=lambda s: str(s["attributes"].get("messaging.message.id"))):
            what = s["attributes"].get("messaging.message.id", "")
            lines.append(f"{'  ' * depth}{s['name']} [{s['kind'].lower()}, pid {s['pid']}] {what}")
            draw(s["span_id"], depth + 1)

    draw(root, 2)
    return "\n".join(lines)


def _descends(span: dict[str, Any], ancestor: str, by_id: dict[str, dict[str, Any]]) -> list[str]:
    """The names of the spans from ``span`` up to the span ``ancestor`` (empty when it does not
    descend from it)."""
    path, current = [span["name"]], span
    while current["parent_id"] is not None:
        if current["parent_id"] == ancestor:
            return path
        parent = by_id.get(current["parent_id"])
        if parent is None:
            return []
        path.append(parent["name"])
        current = parent
    return []


#: the admission locks (store/sql/admit.sql: one per queue, key (1869767425, hashtext(queue)), and
#: the cross-group lock 1869767425 of limits and breakers)
ADMISSION_LOCK = sa.text(
    "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND (objid = 1869767425 OR classid = 1869767425) AND granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def _pause_between_passes(traced: Traced) -> None:
    """SIGSTOP the worker's process group at a moment its reconciler holds no admission lock (a
    worker stopped inside its pass would keep the lock the submit's admission waits for)."""
    while True:
        os.killpg(traced.worker.pid, signal.SIGSTOP)
        with traced.orc.store.engine.connect() as conn:
            if conn.execute(ADMISSION_LOCK).first() is None:
                return
        os.killpg(traced.worker.pid, signal.SIGCONT)
        time.sleep(0.01)


@pytest.fixture(scope="module")
def client_run(traced: Traced) -> tuple[str, dict[str, Any]]:
    """A DAG submitted inside a client span: a -> (b: fails once, retried; c) and lost (its
    first message dropped, re-published by the reconciler) -> d. (run id, client span)."""
    dag = DAG("traced")
    a = dag.task("a", P + "echo", kwargs={"n": 1}, queue=QUEUE)
    lost = dag.task("lost", P + "echo", kwargs={"n": 2}, queue=QUEUE)
    b = dag.task("b", P + "flaky", kwargs={"fail_times": 1}, upstream=[a], max_attempts=2,
                 backoff={"base": 0.1, "cap": 0.2}, queue=QUEUE)  # fmt: skip
    c = dag.task("c", P + "echo", upstream=[a], queue=QUEUE)
    dag.task("d", P + "echo", upstream=[b, c, lost], queue=QUEUE)
    orc = traced.orc
    publisher, orc.publisher = orc.publisher, Dropping(orc.publisher, "lost")
    # the worker is paused while the run is submitted: its reconciler's admission pass must not
    # take a READY root between the submit's transactions (then the submitter would publish
    # neither a.1 nor the lost message, and no re-publish would happen)
    _pause_between_passes(traced)
    try:
        with traced.provider.get_tracer("client").start_as_current_span("client") as span:
            run = orc.submit(dag)
            ctx = span.get_span_context()
    finally:
        os.killpg(traced.worker.pid, signal.SIGCONT)
        orc.publisher = publisher
    assert run.wait(timeout=90).state is RunState.SUCCEEDED
    return run.id, {"trace_id": _hex(ctx.trace_id, 32), "span_id": _hex(ctx.span_id, 16)}


def test_a_dag_submitted_in_a_client_span_is_one_trace(traced: Traced, client_run: tuple[str, dict[str, Any]]) -> None:
    run_id, client = client_run
    attempts = {f"{run_id}.{k}" for k in ("a.1", "lost.1", "b.1", "b.2", "c.1", "d.1")}

    def consumers() -> dict[str, dict[str, Any]]:
        found = {
            s["attributes"].get("messaging.message.id"): s for s in traced.worker_spans() if s["kind"] == "CONSUMER"
        }
        return found if attempts <= set(found) else {}

    consumed = _until("every attempt's span", consumers)
    spans = traced.worker_spans() + traced.client_spans()
    by_id = {s["span_id"]: s for s in spans}
    print(f"\ntrace {client['trace_id']}\n  client [internal, pid {os.getpid()}]\n{_tree(spans, client['span_id'])}")
    assert all(s["trace_id"] == client["trace_id"] for k, s in consumed.items() if k in attempts)
    for task_id in sorted(attempts):
        # each attempt's span is the child of a producer span (its publish), a child of the client's span
        path = _descends(consumed[task_id], client["span_id"], by_id)
        assert len(path) == 2 and path[1].startswith("apply_async/"), (task_id, path)
    producers = {s["attributes"].get("messaging.message.id"): s for s in spans if s["kind"] == "PRODUCER"}
    # a.1 was published by the client; lost.1 re-published by the worker's main process (its
    # reconciler); b.1, c.1 and d.1 by pool processes after a success; b.2 (the retry) by the
    # reconciler or by a pool process whose success passed the slot on
    pool = {s["pid"] for s in traced.worker_spans() if s["kind"] == "CONSUMER"}
    assert producers[f"{run_id}.a.1"]["pid"] == os.getpid()
    assert producers[f"{run_id}.lost.1"]["pid"] not in pool | {os.getpid()}
    assert {producers[f"{run_id}.{k}"]["pid"] for k in ("b.1", "c.1", "d.1")} <= pool
    assert producers[f"{run_id}.b.2"]["pid"] != os.getpid()
    # the failed attempt's span says so
    assert "exception" in consumed[f"{run_id}.b.1"]["events"]


def test_the_ledger_exporter_writes_what_lost(traced: Traced, client_run: tuple[str, dict[str, Any]]) -> None:
    run_id, client = client_run
    orc = traced.orc
    # a late result of b's first attempt (it failed, and b succeeded on its second): fenced
    late = orc.complete(FencingToken(run_id, "b", 1), {"late": True})
    assert not late.accepted
    span = export_run_ledger(orc, run_id, tracer=traced.provider.get_tracer("ledger"))
    assert _hex(span.context.trace_id, 32) == client["trace_id"]
    assert span.parent is not None and _hex(span.parent.span_id, 16) == client["span_id"]
    exported = [s for s in traced.exporter.get_finished_spans() if s.name == "orchestrator.run traced"]
    assert len(exported) == 1
    events = [(e.name, e.attributes) for e in exported[0].events]
    for n, a in events:  # shown by pytest -s
        what = f"{a.get('orchestrator.key') or '-'} {a.get('orchestrator.attempt')}"
        move = f"{a.get('orchestrator.from')} -> {a.get('orchestrator.to')}"
        print(f"  {n:28s} {what:8s} {move} ({a.get('orchestrator.actor')})")
    names = [n for n, _ in events]
    assert "orchestrator.republished" in names and "orchestrator.rejected" in names
    rejected = [a for n, a in events if n == "orchestrator.rejected"]
    assert any(a["orchestrator.key"] == "b" and a["orchestrator.attempt"] == 1 for a in rejected), rejected
    retried = [a for n, a in events if a.get("orchestrator.to") == "RETRYING"]
    assert retried and retried[0]["orchestrator.key"] == "b" and "FlakyError" in str(retried[0]["orchestrator.reason"])
    stamps = [e.timestamp for e in exported[0].events]
    assert stamps == sorted(stamps) and exported[0].start_time <= stamps[0] and stamps[-1] <= exported[0].end_time
    assert exported[0].attributes["orchestrator.state"] == "SUCCEEDED"


def test_sentry_continues_the_submitters_trace(traced: Traced) -> None:
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration
    from sentry_sdk.transport import Transport

    sent: list[Any] = []

    class Memory(Transport):  # type: ignore[misc]
        def capture_envelope(self, envelope: Any) -> None:
            sent.append(envelope)

    dag = DAG("sentry-traced")
    a = dag.task("a", P + "echo", queue=QUEUE)
    dag.task("b", P + "echo", upstream=[a], queue=QUEUE)
    sentry_sdk.init(
        dsn="http://public@127.0.0.1:9/1", transport=Memory, traces_sample_rate=1.0,
        integrations=[CeleryIntegration()], default_integrations=False,
    )  # fmt: skip
    try:
        with sentry_sdk.start_transaction(name="client", op="test") as tx:
            run = traced.orc.submit(dag)
            trace_id, span_id = tx.trace_id, tx.span_id
        stored = traced.orc.reads.trace_contexts([run.id])[run.id]
        assert stored is not None and stored["sentry-trace"].startswith(f"{trace_id}-{span_id}")
    finally:
        sentry_sdk.get_client().close()
        sentry_sdk.get_global_scope().set_client(None)
    assert run.wait(timeout=60).state is RunState.SUCCEEDED

    def transactions() -> list[dict[str, Any]]:
        found = [t for t in _lines(traced.sentry) if t.get("trace_id") == trace_id]
        return found if len(found) >= 2 else []

    found = _until("the worker's Sentry transactions", transactions)
    assert {t["transaction"] for t in found} == {P + "echo"}
    assert all(t["parent_span_id"] == span_id for t in found), found


def test_without_opentelemetry_nothing_breaks(traced: Traced) -> None:
    """A submitter with OpenTelemetry installed but not configured (no tracer provider, no
    instrumentation, no span) and no Sentry: the run has no trace context, its messages none,
    and it runs; each attempt's span on the traced worker starts a trace of its own."""
    script = (
        "import sys; from orchestrator import DAG, default\n"
        f"d = DAG('untraced'); a = d.task('a', '{P}echo', queue='{QUEUE}')\n"
        f"d.task('b', '{P}echo', upstream=[a], queue='{QUEUE}')\n"
        "from orchestrator.runtime.tracing import tracing_on\n"
        "assert not tracing_on()\n"
        "print(default().submit(d).id)\n"
    )
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": str(traced.orc.settings.database_url)}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    run = traced.orc.run(done.stdout.strip())
    assert run.wait(timeout=60).state is RunState.SUCCEEDED
    assert traced.orc.reads.trace_contexts([run.id]) == {run.id: None}

    def consumers() -> list[dict[str, Any]]:
        ids = {s["span_id"]: str(s["attributes"].get("messaging.message.id")) for s in traced.worker_spans()}
        found = [s for s in traced.worker_spans() if ids[s["span_id"]].startswith(run.id)]
        return found if len([s for s in found if s["kind"] == "CONSUMER"]) == 2 else []

    spans = _until("the untraced run's attempt spans", consumers)
    a, b = sorted((s for s in spans if s["kind"] == "CONSUMER"), key=lambda s: s["attributes"]["messaging.message.id"])
    # published by a submitter without tracing: no context at all; or, when the traced worker's
    # reconciler pass admitted it first, under the empty context a run without one is published
    # under (a producer span that starts a trace of its own, never a child of the pass's context)
    by_id = {s["span_id"]: s for s in traced.worker_spans()}
    for consumer in (a, b):
        parent = by_id.get(consumer["parent_id"]) if consumer["parent_id"] is not None else None
        assert consumer["parent_id"] is None or (parent is not None and parent["kind"] == "PRODUCER"
                                                 and parent["parent_id"] is None), (consumer, parent)  # fmt: skip
    assert b["trace_id"] != a["trace_id"]  # b's publish (traced worker) is not a child of a's span
    # the ledger of a run without a context: a trace of its own
    span = export_run_ledger(traced.orc, run.id, tracer=traced.provider.get_tracer("ledger"))
    assert span.parent is None and {e.name for e in span.events} == {"orchestrator.run", "orchestrator.transition"}
