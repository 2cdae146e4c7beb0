"""Replay: pacing recorded traffic onto the engine, admission, and prompt synthesis."""
