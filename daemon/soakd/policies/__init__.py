"""Policies: pure functions and state machines over windows of readings, with no I/O of their own."""
