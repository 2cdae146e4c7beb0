"""Recorded traffic: read, validate and summarise traces (native, Mooncake, synthetic) as RequestSpecs."""

from soakd.traces.loader import Trace, open_trace
from soakd.traces.model import RequestSpec, TraceSummary
from soakd.traces.native import write_native
from soakd.traces.synth import synthesize

__all__ = ["RequestSpec", "Trace", "TraceSummary", "open_trace", "synthesize", "write_native"]
