"""OpenTelemetry for the tutor: one span per agent per turn under a `tutor.turn` span. Off by
default (the API's no-op tracer); `console` prints spans, `otlp` sends them over OTLP/HTTP to a
collector (the standard OTEL_EXPORTER_OTLP_* variables apply)."""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

log = logging.getLogger(__name__)
EXPORTERS = ("off", "console", "otlp")


def setup_tracing(exporter: str, endpoint: str | None = None) -> TracerProvider | None:
    if exporter not in EXPORTERS:
        raise ValueError(f"--otel must be one of {', '.join(EXPORTERS)}, got {exporter!r}")
    if exporter == "off":
        return None
    out: SpanExporter
    if exporter == "console":
        out = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        out = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "tutorserve"}))
    provider.add_span_processor(BatchSpanProcessor(out))
    trace.set_tracer_provider(provider)
    log.info("tutor tracing on: %s exporter", exporter)
    return provider
