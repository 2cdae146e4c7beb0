"""The sinks' health collectors: `spool` and `sink` points through the real runner, writer and spool,
still written while the spool keeps only essential measurements."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from soakd.collectors.base import Collector
from soakd.collectors.runner import CollectorRunner
from soakd.errors import SinkError
from soakd.metric import Sample
from soakd.sinks.forwarder import Forwarder
from soakd.sinks.health import SinkHealth, SpoolHealth
from soakd.sinks.spool import STATE_CODES, Spool, iter_samples
from soakd.sinks.writer import SampleWriter


class DownWriter:
    async def write(self, lines: Sequence[str]) -> None:
        raise SinkError("connection refused")

    async def ping(self) -> str:
        raise SinkError("connection refused")

    async def aclose(self) -> None:
        return None


class Gpu:
    name = "gpu"

    def collect(self, now_ns: int) -> list[Sample]:
        return [Sample("gpu", {"power_w": 300.0}, now_ns)]

    def close(self) -> None:
        return None


async def test_health_points_survive_a_degraded_spool(tmp_path: Path) -> None:
    now = [1_700_000_000_000_000_000]
    spool = Spool(tmp_path, 1 << 20, 1.0, max_bytes=3000)
    writer = SampleWriter(spool, {"run_id": "r"}, wall_ns=lambda: now[0])
    spool.on_event = lambda kind, fields: writer.event(kind, f"spool {kind}", **fields)
    fwd = Forwarder(tmp_path, DownWriter(), batch_lines=100, clock=lambda: 0.0)
    collectors: list[Collector] = [Gpu(), SpoolHealth(spool), SinkHealth(fwd)]
    runner = CollectorRunner(collectors, writer, wall_ns=lambda: now[0])
    for _ in range(12):
        await fwd.step()
        runner.run_once()
        now[0] += 1_000_000_000
    spool.close()

    assert spool.state == "essential"
    gpu = list(iter_samples(tmp_path, "gpu"))
    spool_points = list(iter_samples(tmp_path, "spool"))
    sink_points = list(iter_samples(tmp_path, "sink"))
    # The periodic series stopped at the bound; the health series went on, one point per run.
    assert 0 < len(gpu) < 12
    assert len(spool_points) == len(sink_points) == 12
    assert spool.dropped["gpu"] == 12 - len(gpu)
    last = spool_points[-1].fields
    assert last["state"] == STATE_CODES["essential"] and last["state_name"] == "essential"
    assert last["dropped_gpu"] == spool.dropped["gpu"] - 1  # this point was read before the last drop
    assert last["dropped_collector"] == spool.dropped["collector"] - 3
    assert isinstance(last["bytes"], int) and last["bytes"] >= 3000
    sink = sink_points[-1].fields
    assert sink["failures"] == 1  # the first step failed; the rest backed off
    assert sink["consecutive_failures"] == 1
    assert isinstance(sink["backlog_lines"], int) and sink["backlog_lines"] > 0
    assert sink["backlog_age_s"] == 11.0  # the first line ever written is 11 s old at the last run
    assert sink_points[-1].tags == {"run_id": "r"}
    kinds = [s.tags["kind"] for s in iter_samples(tmp_path, "events")]
    assert kinds == ["spool_degraded"]


def test_collectors_have_the_protocol_shape(tmp_path: Path) -> None:
    spool = Spool(tmp_path, 1 << 20, 1.0)
    fwd = Forwarder(tmp_path, DownWriter(), batch_lines=10)
    health: list[Collector] = [SpoolHealth(spool), SinkHealth(fwd)]
    assert [c.name for c in health] == ["spool", "sink"]
    samples = [s for c in health for s in c.collect(5)]
    assert [(s.measurement, s.time_ns) for s in samples] == [("spool", 5), ("sink", 5)]
    assert samples[0].fields["segments"] == 1 and samples[0].fields["dropped_total"] == 0
    assert samples[1].fields["backlog_lines"] == 0
    for c in health:
        c.close()
    spool.close()
