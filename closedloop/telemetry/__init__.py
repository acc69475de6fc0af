"""Runs as OpenTelemetry traces (GenAI semantic conventions), so Phoenix, Langfuse or Jaeger open them.

:mod:`closedloop.telemetry.spans` turns runs, turns and tool calls into spans;
:mod:`closedloop.telemetry.otlp` exports stored runs over OTLP/HTTP (``closedloop runs export
--format otlp``); :mod:`closedloop.telemetry.live` exports while a graph runs (opt-in recorder).
Needs ``pip install 'closedloop[otel]'`` (the OpenTelemetry SDK and its OTLP/HTTP exporter).
"""
