"""Throttle state of the host's CPUs during a soak: the detector fed with every host pass (through
HostCollector's `on_read` hook), its transitions written as `throttle_*` events, and a `throttle` point
with `scope=host` per interval."""

from __future__ import annotations

from collections.abc import Sequence

from soakd.collectors.gpu_throttle import STATE_CODE, EventFn, emit_transition
from soakd.collectors.host import HostThrottleReading
from soakd.metric import FieldValue, Sample
from soakd.policies.throttle import ThrottleDetector, ThrottleSettings, ThrottleState, host_input


class HostThrottleWatch:
    """One ThrottleDetector over all of the host's CPUs. `observe` is HostCollector's `on_read` hook."""

    name = "host_throttle"

    def __init__(
        self,
        on_event: EventFn,
        settings: ThrottleSettings | None = None,
        *,
        active_cpu_percent: float = 25.0,
    ) -> None:
        # No max clock: the ratio is taken against the run's early active clock. cpufreq's max is the
        # single-core turbo, which an all-core load never sustains and would read as constant throttling.
        self._detector = ThrottleDetector(settings, max_mhz=None)
        self._on_event = on_event
        self._active_cpu_percent = active_cpu_percent
        self.transitions = 0

    def observe(self, t_s: float, reading: HostThrottleReading) -> None:
        counts = {
            name: total
            for name, total in (
                ("core", reading.core_throttle_total),
                ("package", reading.package_throttle_total),
            )
            if total is not None
        }
        # Clocks drop when the CPUs idle; only a busy machine's clock says anything about throttling.
        active = None if reading.cpu_percent is None else reading.cpu_percent >= self._active_cpu_percent
        inp = host_input(t_s, reading.cpu_mhz, None, counts, reading.thermal_margin_c, active=active)
        for tr in self._detector.update(inp):
            self.transitions += 1
            emit_transition(self._on_event, tr, "host CPUs", {"scope": "host"})

    @property
    def state(self) -> ThrottleState:
        return self._detector.state

    def collect(self, now_ns: int) -> Sequence[Sample]:
        det = self._detector
        fields: dict[str, FieldValue] = {"state": STATE_CODE[det.state], "throttled_s": det.throttled_s}
        for name, events in det.per_reason_events.items():
            fields[f"throttle_{name}_events_total"] = events
        return [Sample("throttle", fields, now_ns, tags={"scope": "host"})]

    def summary(self) -> dict[str, object]:
        return self._detector.summary()

    def close(self) -> None:
        return None
