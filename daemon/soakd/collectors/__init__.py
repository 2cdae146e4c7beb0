"""Collectors: each turns one source of telemetry into Samples on a schedule."""
