"""The settings of the policies and detectors come from the config one way, each by its `from_config`:
a section's defaults are the settings' defaults (written once, in config.py), and every configured
value reaches them."""

from __future__ import annotations

from soakd.collectors.spec import DriftSettings
from soakd.config import (
    BatchControlConfig,
    HarmControlConfig,
    RecaptureControlConfig,
    SpecDriftConfig,
    load,
)
from soakd.policies.downscale import BatchSettings
from soakd.policies.recapture import RecaptureSettings
from soakd.policies.throttle import HarmSettings, ThroughputSettings


def test_the_default_sections_make_the_default_settings() -> None:
    assert HarmSettings.from_config(HarmControlConfig()) == HarmSettings()
    assert ThroughputSettings.from_config(HarmControlConfig()) == ThroughputSettings()
    assert RecaptureSettings.from_config(RecaptureControlConfig()) == RecaptureSettings()
    assert BatchSettings.from_config(BatchControlConfig(), 64) == BatchSettings(start=64)
    drift = DriftSettings.from_config(SpecDriftConfig())
    assert drift == DriftSettings(drift.baseline_s, drift.window_s, drift.threshold)


def test_every_configured_value_reaches_the_settings() -> None:
    cfg = load(
        None,
        {
            "control.harm.window": "2s",
            "control.harm.power_loss": 0.2,
            "control.harm.thermal_loss": 0.05,
            "control.harm.enter": "3s",
            "control.harm.leave": "20s",
            "control.harm.stale": "90s",
            "control.harm.throughput_loss": 0.3,
            "control.recapture.idle": "2m",
            "control.recapture.min_hit_rate": 0.8,
            "control.recapture.min_gain": 0.1,
            "control.recapture.min_steps": 500,
            "control.recapture.cooldown": "10m",
            "control.recapture.long_idle": "2h",
            "control.recapture.quantile": 0.95,
            "control.recapture.max_sizes": 6,
            "control.recapture.max_size": 512,
            "control.recapture.align": 8,
            "telemetry.spec_drift.baseline": "1m",
            "telemetry.spec_drift.window": "2m",
            "telemetry.spec_drift.threshold": 0.3,
            "telemetry.spec_drift.min_draft_tokens": 50,
        },
    )
    h = cfg.control.harm
    assert HarmSettings.from_config(h) == HarmSettings(
        window_s=2.0, power_loss=0.2, thermal_loss=0.05, enter_s=3.0, leave_s=20.0, stale_s=90.0
    )
    assert ThroughputSettings.from_config(h) == ThroughputSettings(loss=0.3, leave_s=20.0)
    assert RecaptureSettings.from_config(cfg.control.recapture) == RecaptureSettings(
        idle_s=120.0,
        min_hit_rate=0.8,
        min_gain=0.1,
        min_steps=500,
        cooldown_s=600.0,
        long_idle_s=7200.0,
        quantile=0.95,
        max_sizes=6,
        max_size=512,
        align=8,
    )
    assert DriftSettings.from_config(cfg.telemetry.spec_drift) == DriftSettings(60.0, 120.0, 0.3, 50)
    # No cap is 0 in the config and None in the settings.
    assert RecaptureSettings.from_config(RecaptureControlConfig(max_size=0)).max_size is None
