"""soakd: an endurance and telemetry daemon for LLM inference."""

__version__ = "0.1.0"
