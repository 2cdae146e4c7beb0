"""The host throttle watch fed by HostCollector over a fake sysfs tree, with an injected clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from soakd.collectors.host import HostCollector, HostThrottleReading
from soakd.collectors.host_throttle import HostThrottleWatch
from soakd.metric import FieldValue
from soakd.policies.throttle import ThrottleSettings, ThrottleState

S = 10**9
CPUS = 4


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@dataclass
class Event:
    kind: str
    text: str
    fields: dict[str, FieldValue]
    t_s: float


@dataclass
class Rig:
    """A fake host: sysfs under `root`, psutil's cpu_percent patched, one collect per `step`."""

    root: Path
    monkeypatch: pytest.MonkeyPatch
    settings: ThrottleSettings | None = None
    t: float = 0.0
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        cpu = self.root / "sys/devices/system/cpu"
        for n in range(CPUS):
            _write(cpu / f"cpu{n}/thermal_throttle/core_throttle_count", "7")
            _write(cpu / f"cpu{n}/thermal_throttle/package_throttle_count", "3")
            _write(cpu / f"cpu{n}/topology/physical_package_id", "0")
            # cpufreq's max is the single-core turbo: far above what an all-core load sustains.
            _write(cpu / f"cpu{n}/cpufreq/scaling_max_freq", "4500000")
            _write(cpu / f"cpu{n}/cpufreq/scaling_cur_freq", "800000")  # present at discovery
        zone = self.root / "sys/class/thermal/thermal_zone0"
        _write(zone / "type", "x86_pkg_temp")
        _write(zone / "trip_point_0_type", "passive")
        _write(zone / "trip_point_0_temp", "95000")
        self.set_temp(60.0)
        self.spool = self.root / "spool"
        self.spool.mkdir()
        self.cpu_percent = 0.0
        self.monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: self.cpu_percent)
        self.watch = HostThrottleWatch(self.on_event, self.settings)
        self.collector = HostCollector(
            list, self.spool, root=self.root, on_read=self.watch.observe, clock=lambda: self.t
        )

    def on_event(self, kind: str, text: str, **fields: FieldValue) -> None:
        self.events.append(Event(kind, text, fields, self.t))

    def set_temp(self, c: float) -> None:
        _write(self.root / "sys/class/thermal/thermal_zone0/temp", str(round(c * 1000)))

    def add_core_throttles(self, n: int) -> None:
        path = self.root / "sys/devices/system/cpu/cpu1/thermal_throttle/core_throttle_count"
        _write(path, str(int(path.read_text()) + n))

    def step(self, cpu_percent: float, mhz: float, seconds: int = 1) -> None:
        """`seconds` passes, one a second, all CPUs at `mhz` and the machine `cpu_percent` busy."""
        for n in range(CPUS):
            _write(
                self.root / f"sys/devices/system/cpu/cpu{n}/cpufreq/scaling_cur_freq", str(round(mhz * 1000))
            )
        self.cpu_percent = cpu_percent
        for _ in range(seconds):
            self.collector.collect(round(self.t * S))
            self.t += 1.0

    def kinds(self) -> list[tuple[str, float]]:
        return [(e.kind, e.t_s) for e in self.events]


@pytest.fixture
def rig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Rig:
    return Rig(tmp_path, monkeypatch)


def test_core_counter_growth_enters_recovers_and_leaves(rig: Rig) -> None:
    rig.step(90.0, 3000.0, seconds=20)
    assert rig.events == []
    rig.add_core_throttles(4)
    rig.step(90.0, 3000.0, seconds=60)  # the growth is seen at t=20; steady from then on

    # Enter at once; "recovering" when the growth has left the 5 s window and the 10 s dwell is
    # served; "ok" after 30 s of quiet.
    assert rig.kinds() == [("throttle_enter", 20.0), ("throttle_recovering", 30.0), ("throttle_leave", 60.0)]
    enter = rig.events[0]
    assert enter.fields["reasons"] == "counter:core"
    assert enter.fields["scope"] == "host"
    assert enter.fields["from_state"] == "ok"
    assert enter.fields["to_state"] == "throttled"
    assert enter.fields["clock_ratio"] == 1.0
    assert "gpu" not in enter.fields
    assert enter.text.startswith("host CPUs: ok -> throttled (")
    assert "counters_grew=core" in enter.text
    assert rig.events[2].fields["reasons"] == ""

    (sample,) = rig.watch.collect(99 * S)
    assert sample.measurement == "throttle"
    assert sample.tags == {"scope": "host"}
    assert sample.time_ns == 99 * S
    assert sample.fields == {"state": 0, "throttled_s": 10.0, "throttle_core_events_total": 4}
    summary = rig.watch.summary()
    assert summary["enters"] == 1
    assert summary["per_reason_events"] == {"core": 4}
    assert summary["baseline_mhz"] == 3000.0


def test_clock_drop_under_load_enters_against_the_early_clock(rig: Rig) -> None:
    # 60 s all-core at 3000 MHz: 2/3 of cpufreq's 4500 MHz max, yet no throttling (the baseline is
    # the early active clock).
    rig.step(95.0, 3000.0, seconds=60)
    assert rig.events == []
    assert rig.watch.summary()["baseline_mhz"] == 3000.0
    rig.step(95.0, 2400.0, seconds=20)  # ratio 0.8 from t=60
    rig.step(95.0, 3000.0, seconds=60)  # back from t=80

    # The 5 s window's median ratio drops under 0.85 once 3 of its 5 samples are low (t=62), and
    # rises over 0.93 once 3 are back (t=82); recovery ends 30 s later.
    assert rig.kinds() == [("throttle_enter", 62.0), ("throttle_recovering", 82.0), ("throttle_leave", 112.0)]
    enter = rig.events[0]
    assert enter.fields["reasons"] == ""
    assert enter.fields["clock_ratio"] == pytest.approx(0.8)
    assert "sm_clock=2400MHz (0.800 of 3000MHz)" in str(enter.fields["detail"])  # as the plot draws it
    (sample,) = rig.watch.collect(140 * S)
    assert sample.fields["throttled_s"] == 20.0
    assert "throttle_core_events_total" not in sample.fields  # counters never grew


def test_low_clocks_while_idle_are_not_throttling(rig: Rig) -> None:
    rig.step(95.0, 3000.0, seconds=60)
    rig.step(3.0, 800.0, seconds=60)  # idle: the governor parks the clocks
    rig.step(24.9, 1200.0, seconds=30)  # still under the 25 % activity threshold
    rig.step(95.0, 3000.0, seconds=10)
    assert rig.events == []
    assert rig.watch.state is ThrottleState.OK
    (sample,) = rig.watch.collect(0)
    assert sample.fields == {"state": 0, "throttled_s": 0.0}


def test_activity_threshold_is_configurable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = Rig(tmp_path, monkeypatch)
    rig.watch = HostThrottleWatch(rig.on_event, active_cpu_percent=50.0)
    rig.collector = HostCollector(
        list, rig.spool, root=tmp_path, on_read=rig.watch.observe, clock=lambda: rig.t
    )
    rig.step(95.0, 3000.0, seconds=60)
    rig.step(40.0, 1500.0, seconds=20)  # would be "active" at the default 25 %
    assert rig.events == []
    rig.step(50.0, 1500.0, seconds=5)
    assert [k for k, _ in rig.kinds()] == ["throttle_enter"]
    assert rig.events[0].fields["clock_ratio"] == pytest.approx(0.5)


def test_thermal_margin_from_trip_point_enters_and_recovers(rig: Rig) -> None:
    rig.step(90.0, 3000.0, seconds=20)
    rig.set_temp(91.5)  # 3.5 C under the 95 C passive trip
    rig.step(90.0, 3000.0, seconds=15)
    rig.set_temp(85.0)  # 10 C: above the 8 C leave level
    rig.step(90.0, 3000.0, seconds=60)
    # Enter at once at t=20; quiet once the 5 s window (35..39) holds no low margin; ok 30 s later.
    assert rig.kinds() == [("throttle_enter", 20.0), ("throttle_recovering", 39.0), ("throttle_leave", 69.0)]
    assert rig.events[0].fields["reasons"] == ""
    assert "thermal_margin_c=3.5" in rig.events[0].text


def test_recovering_goes_back_to_throttled_when_counters_grow_again(rig: Rig) -> None:
    rig.step(90.0, 3000.0, seconds=5)
    rig.add_core_throttles(1)
    rig.step(90.0, 3000.0, seconds=17)  # enter at 5, recovering at 15
    rig.add_core_throttles(2)
    rig.step(90.0, 3000.0, seconds=5)  # seen at t=22
    # Back to throttled once the 10 s dwell in "recovering" is served (t=25), while the growth at
    # t=22 is still in the 5 s window.
    assert rig.kinds() == [("throttle_enter", 5.0), ("throttle_recovering", 15.0), ("throttle_enter", 25.0)]
    assert rig.events[2].fields["from_state"] == "recovering"
    assert rig.events[2].fields["reasons"] == "counter:core"
    assert rig.watch.summary()["per_reason_events"] == {"core": 3}


def test_observe_uses_only_the_signals_present() -> None:
    events: list[tuple[str, dict[str, FieldValue]]] = []
    watch = HostThrottleWatch(lambda kind, _text, **f: events.append((kind, f)))
    # No package counter, no clock, no margin, utilization unknown: only the core count can signal.
    for t, core in enumerate([10, 10, 10, 12]):
        watch.observe(float(t), HostThrottleReading(None, core, None, None, None))
    assert [(k, f["reasons"]) for k, f in events] == [("throttle_enter", "counter:core")]
    assert "clock_ratio" not in events[0][1]
    assert watch.summary()["per_reason_events"] == {"core": 2}
    assert watch.summary()["baseline_mhz"] is None
    watch.close()


def test_unknown_utilization_still_judges_the_clock() -> None:
    events: list[str] = []
    watch = HostThrottleWatch(
        lambda kind, _text, **_f: events.append(kind), ThrottleSettings(baseline_samples=5)
    )
    for t in range(20):
        mhz = 3000.0 if t < 10 else 2000.0
        watch.observe(float(t), HostThrottleReading(mhz, None, None, None, None))
    assert events == ["throttle_enter"]
    assert watch.state is ThrottleState.THROTTLED
