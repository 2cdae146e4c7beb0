"""The NVML error-event listener, over a fake pynvml whose event set is a queue."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace
from typing import Any

from soakd.collectors.nvml_events import GpuEventListener


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeEvents:
    """The event-set part of pynvml for two GPUs; checks every set call comes from one thread."""

    NVMLError = NVMLError
    nvmlEventTypeXidCriticalError = 0x8
    nvmlEventTypeDoubleBitEccError = 0x2

    def __init__(self, supported: dict[str, int], fail_wait_with: int | None = None) -> None:
        self.supported = supported
        self.events: queue.Queue[Any] = queue.Queue()
        self.registered: list[tuple[str, int]] = []
        self.calls: list[str] = []
        self.threads: set[int] = set()
        self.fail_wait_with = fail_wait_with
        self.waits = 0

    def _on_thread(self) -> None:
        self.threads.add(threading.get_ident())

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetSupportedEventTypes(self, h: str) -> int:
        return self.supported.get(h, 0)

    def nvmlEventSetCreate(self) -> str:
        self._on_thread()
        return "set"

    def nvmlDeviceRegisterEvents(self, h: str, mask: int, event_set: str) -> None:
        self._on_thread()
        self.registered.append((h, mask))

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        self._on_thread()
        self.waits += 1
        if self.fail_wait_with is not None:
            raise NVMLError(self.fail_wait_with)
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(10) from None  # NVML_ERROR_TIMEOUT

    def nvmlEventSetFree(self, event_set: str) -> None:
        self._on_thread()
        self.calls.append("free")

    def push(self, gpu: int, kind: int, data: int) -> None:
        self.events.put(SimpleNamespace(device=f"h{gpu}", eventType=kind, eventData=data))


def test_xid_and_ecc_events_become_events_points_and_summary() -> None:
    nv = FakeEvents({"h0": 0x8 | 0x2 | 0x1, "h1": 0x8})
    seen: list[tuple[str, str, dict[str, Any]]] = []
    listener = GpuEventListener(nv, [0, 1], lambda k, m, **f: seen.append((k, m, f)), wait_ms=20)
    assert listener.start() is True
    # Only the wanted types the GPU supports: GPU 0 not for single-bit ECC (0x1), GPU 1 XID only.
    assert nv.registered == [("h0", 0x8 | 0x2), ("h1", 0x8)]
    assert listener.registered == {0: ["xid", "ecc_double_bit"], 1: ["xid"]}
    nv.push(1, 0x8, 79)
    nv.push(0, 0x8, 43)
    nv.push(0, 0x2, 0)
    points = []
    for _ in range(300):
        points += listener.collect(5)
        if len(seen) == 3:
            break
        threading.Event().wait(0.01)
    assert [k for k, _, _ in seen] == ["gpu_xid", "gpu_xid", "gpu_error"]
    assert seen[0][1] == "GPU 1: XID 79 (GPU has fallen off the bus)"
    assert seen[0][2] == {"gpu": 1, "event": "xid", "data": 79, "xid": 79, "benign": False}
    assert seen[1][2]["benign"] is True and seen[2][2]["event"] == "ecc_double_bit"
    errors = {}
    for p in points:
        errors[p.tags["gpu"]] = errors.get(p.tags["gpu"], 0) + p.fields["errors"]
    assert errors == {"0": 2, "1": 1}
    s = listener.summary()
    assert s["xid_errors"] == 1 and s["xid_benign"] == 1
    assert s["totals"] == {"ecc_double_bit": 1, "xid": 2, "xid_43": 1, "xid_79": 1}
    listener.stop()
    assert not listener._thread or not listener._thread.is_alive()
    assert nv.calls == ["init", "free", "shutdown"]
    assert len(nv.threads) == 1 and threading.get_ident() not in nv.threads  # the set never left its thread


def test_no_supported_event_type_is_unavailable_with_a_reason() -> None:
    nv = FakeEvents({})
    listener = GpuEventListener(nv, [0, 1], lambda *a, **k: None)
    assert listener.start() is False
    assert listener.reason == "no GPU supports the error event types"
    assert listener.collect(1) == [] and listener.summary()["listening"] is False
    listener.stop()
    assert nv.calls == ["init", "free", "shutdown"]


def test_a_failing_wait_ends_listening_once_and_says_why() -> None:
    nv = FakeEvents({"h0": 0x8}, fail_wait_with=15)  # NVML_ERROR_GPU_IS_LOST
    listener = GpuEventListener(nv, [0], lambda *a, **k: None, wait_ms=10)
    listener.start()
    assert listener._thread is not None
    listener._thread.join(2.0)
    assert not listener._thread.is_alive() and nv.waits == 1
    assert listener.available is False and "NVML error 15" in listener.reason
    # Idle points still come for the registered GPU, with no errors.
    (p,) = listener.collect(1)
    assert p.fields == {"errors": 0} and p.tags == {"gpu": "0"}


def test_timeouts_keep_waiting_until_stopped() -> None:
    nv = FakeEvents({"h0": 0x8})
    listener = GpuEventListener(nv, [0], lambda *a, **k: None, wait_ms=5)
    listener.start()
    for _ in range(200):
        if nv.waits >= 5:
            break
        threading.Event().wait(0.01)
    assert nv.waits >= 5 and listener.available
    listener.close()
    assert listener._thread is not None and not listener._thread.is_alive()
