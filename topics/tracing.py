"""W3C trace context in Kafka message headers, so one trace follows a prompt through every worker.

The producer of a message injects the context of its current span (the
`traceparent`/`tracestate` headers); the consumer extracts it and opens its own
spans as children, whatever process or host it runs on.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace


def trace_headers(span: trace.Span | None = None) -> dict[str, str]:
    """Headers carrying `span`'s context (the current span's by default); empty when nothing is sampled."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    return carrier


def context_of_headers(headers: Iterable[tuple[str, bytes]] | None) -> otel_context.Context:
    """The trace context a record's producer sent along in its headers (an empty context if none)."""
    carrier = {name: value.decode(errors="replace") for name, value in (headers or ())}
    return propagate.extract(carrier)
