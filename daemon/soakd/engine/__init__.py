"""Engine adapters: the only code that talks to the inference engine."""
