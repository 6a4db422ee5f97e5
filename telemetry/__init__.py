"""telemetry: OpenTelemetry setup from the ``OTEL_*`` variables, W3C propagation, span/attribute names.

Imports nothing of ours: the gateway and the worker call it, never the other way round.
"""

from telemetry.propagation import extract, inject
from telemetry.setup import Telemetry, TelemetryConfigError, configure

__all__ = ["Telemetry", "TelemetryConfigError", "configure", "extract", "inject"]
