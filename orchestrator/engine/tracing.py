"""Trace context: the submitter's, captured at submit and stored on the run
(``orc_runs.trace_context``), so that every message of the run carries it whoever publishes it
(``orchestrator.runtime.tracing``).

What is captured, as text headers (a W3C-style carrier):

- OpenTelemetry's, through its API's global propagator when ``opentelemetry-api`` is installed
  and a span is current: ``traceparent``, ``tracestate``, ``baggage`` (W3C by default);
- Sentry's, when ``sentry_sdk`` is loaded and its client is active: ``sentry-trace`` and its
  ``baggage`` (merged into OpenTelemetry's ``baggage`` when both have one).

Nothing when neither is there: ``None`` is stored and the run's messages carry no context.
"""

from __future__ import annotations

import sys
from typing import Any

#: OpenTelemetry's ``propagate`` module once imported; ``False``: not installed (asked once)
_propagate: Any = None


def _otel_propagate() -> Any:
    """OpenTelemetry's ``propagate`` module, or ``None`` when the API is not installed."""
    global _propagate
    if _propagate is None:
        try:
            from opentelemetry import propagate  # type: ignore[attr-defined,unused-ignore]
        except ImportError:
            _propagate = False
        else:
            _propagate = propagate
    return _propagate or None


def merge_baggage(first: str | None, second: str | None) -> str | None:
    """Two ``baggage`` headers as one (W3C baggage is a comma-separated list of members)."""
    parts = [b for b in (first, second) if b]
    return ",".join(parts) or None


def sentry_headers() -> dict[str, str]:
    """Sentry's trace headers of the current scope (``sentry-trace``, ``baggage``), when the
    Sentry SDK is loaded and active; ``{}`` otherwise (the SDK is never imported here)."""
    sentry = sys.modules.get("sentry_sdk")
    if sentry is None or not sentry.get_client().is_active():
        return {}
    found: dict[str, str] = {}
    traceparent = sentry.get_traceparent()
    if traceparent:
        found["sentry-trace"] = str(traceparent)
    baggage = sentry.get_baggage()
    if baggage:
        found["baggage"] = str(baggage)
    return found


def capture_trace_context() -> dict[str, str] | None:
    """The caller's trace context as text headers, or ``None`` (no OpenTelemetry span and no
    active Sentry client)."""
    carrier: dict[str, Any] = {}
    propagate = _otel_propagate()
    if propagate is not None:
        propagate.inject(carrier)
    sentry = sentry_headers()
    if sentry:
        baggage = merge_baggage(carrier.get("baggage"), sentry.pop("baggage", None))
        carrier.update(sentry)
        if baggage:
            carrier["baggage"] = baggage
    return {k: str(v) for k, v in carrier.items()} or None
