"""Trace context: the submitter's, captured at submit and stored on the run, so that every
message of the run carries it whoever publishes it (W3C ``traceparent``/``tracestate``, through
the OpenTelemetry API when it is installed; nothing when it is not)."""

from __future__ import annotations

from typing import Any


def capture_trace_context() -> dict[str, str] | None:
    """The caller's trace context as W3C headers, or ``None`` (no OpenTelemetry, or no span)."""
    try:
        from opentelemetry import propagate  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return None
    carrier: dict[str, Any] = {}
    propagate.inject(carrier)
    return {k: str(v) for k, v in carrier.items()} or None
