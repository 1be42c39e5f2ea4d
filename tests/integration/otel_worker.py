"""``celery -A tests.integration.otel_worker worker``: the project's app on a worker traced as a
user would trace it — OpenTelemetry's SDK with its Celery instrumentation, and Sentry's SDK with
its Celery integration — each writing what it records to a file the test reads (JSON lines):

- ``ORC_TEST_SPANS``: every span ended in any process of the worker (its main process, where
  the reconciler re-publishes and retries, and its pool processes);
- ``ORC_TEST_SENTRY``: every Sentry transaction (no network: a transport of our own).

Both are set up at import, in the worker's main process, before the pool forks: the span
processor is synchronous (no thread to lose at the fork) and the file is opened per write.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import sentry_sdk
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from sentry_sdk.envelope import Envelope
from sentry_sdk.integrations.celery import CeleryIntegration
from sentry_sdk.transport import Transport

from orchestrator.celery_app import get_app


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A span as one JSON object: ids in hex, as W3C writes them."""
    ctx, parent = span.context, span.parent
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "attributes": {k: v if isinstance(v, (str, int, float, bool)) else str(v) for k, v in span.attributes.items()},
        "events": [e.name for e in span.events],
        "pid": os.getpid(),
    }


class JsonLinesExporter(SpanExporter):
    """Appends every span to a file, one JSON object a line (each line one ``write``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        text = "".join(json.dumps(span_record(s)) + "\n" for s in spans)
        with open(self.path, "a") as out:
            out.write(text)
        return SpanExportResult.SUCCESS


class FileTransport(Transport):
    """Sentry's envelopes written to a file instead of sent: the transactions, as JSON lines."""

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self.path = os.environ["ORC_TEST_SENTRY"]

    def capture_envelope(self, envelope: Envelope) -> None:
        lines = []
        for item in envelope.items:
            if item.type == "transaction" and item.payload.json is not None:
                tx = item.payload.json
                trace_ctx = tx.get("contexts", {}).get("trace", {})
                lines.append(json.dumps({"transaction": tx.get("transaction"), **trace_ctx, "pid": os.getpid()}))
        if lines:
            with open(self.path, "a") as out:
                out.write("".join(line + "\n" for line in lines))


if os.environ.get("ORC_TEST_SPANS"):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ["ORC_TEST_SPANS"])))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument()

if os.environ.get("ORC_TEST_SENTRY"):
    sentry_sdk.init(
        dsn="http://public@127.0.0.1:9/1",
        transport=FileTransport,
        traces_sample_rate=1.0,
        integrations=[CeleryIntegration()],
        default_integrations=False,
    )

app = get_app()
