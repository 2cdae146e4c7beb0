"""The languages config.toml is written in beyond TOML itself: the criteria checks."""
