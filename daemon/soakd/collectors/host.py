"""Host telemetry through psutil: CPU, frequency, temperatures, memory, and the engine's RSS."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from soakd.metric import Sample


class HostCollector:
    """CPU and memory of the machine, RSS of the engine's processes, free space under the spool."""

    name = "host"

    def __init__(self, engine_pids: Callable[[], list[int]], spool_dir: Path) -> None:
        self._engine_pids = engine_pids
        self._spool_dir = spool_dir
        self._procs: dict[int, psutil.Process] = {}
        # cpu_percent(None) measures since the previous call; the first call only primes it.
        psutil.cpu_percent(None)

    def _rss(self, pids: list[int]) -> tuple[int, int]:
        total = 0
        alive = 0
        for pid in pids:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                total += proc.memory_info().rss
                alive += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                self._procs.pop(pid, None)
        for gone in set(self._procs) - set(pids):
            del self._procs[gone]
        return total, alive

    def collect(self, now_ns: int) -> Sequence[Sample]:
        fields: dict[str, float | int] = {"cpu_percent": float(psutil.cpu_percent(None))}
        freq = psutil.cpu_freq()
        if freq is not None and freq.current:
            fields["cpu_freq_mhz"] = float(freq.current)
        load1, _, _ = os.getloadavg()
        fields["load1"] = float(load1)
        mem = psutil.virtual_memory()
        fields["mem_used_bytes"] = int(mem.used)
        fields["mem_available_bytes"] = int(mem.available)
        fields["mem_percent"] = float(mem.percent)
        fields["swap_used_bytes"] = int(psutil.swap_memory().used)
        temps = getattr(psutil, "sensors_temperatures", None)
        if temps is not None:
            readings = [t.current for group in temps().values() for t in group if t.current]
            if readings:
                fields["temp_max_c"] = float(max(readings))
        rss, procs = self._rss(self._engine_pids())
        fields["engine_rss_bytes"] = rss
        fields["engine_procs"] = procs
        fields["soakd_rss_bytes"] = int(psutil.Process().memory_info().rss)
        fields["spool_disk_free_bytes"] = int(psutil.disk_usage(str(self._spool_dir)).free)
        return [Sample("host", fields, now_ns)]

    def close(self) -> None:
        self._procs.clear()
