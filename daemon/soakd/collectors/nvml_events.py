"""GPU error events from NVML (XID critical errors, double-bit ECC, row-retirement failures, poison,
GPU unavailable) as `gpu_xid` / `gpu_error` events, caught the moment the driver reports them.

A polled counter cannot say which XID happened or when: NVML's event set can. It blocks in
`nvmlEventSetWait_v2`, so it lives in its own thread; NVML event sets are not thread-safe, so that
thread alone creates, registers, waits on and frees the set. What it sees goes into a locked list
that `collect` drains on the event loop, where the events are written like every other event.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from soakd.metric import FieldValue, Sample

log = structlog.get_logger(__name__)

EventFn = Callable[..., None]

# nvmlEventType* bits (NVML ABI); getattr on the binding where it has them, these where it does not.
_EVENT_TYPES: tuple[tuple[str, int, str], ...] = (
    ("nvmlEventTypeXidCriticalError", 0x8, "xid"),
    ("nvmlEventTypeDoubleBitEccError", 0x2, "ecc_double_bit"),
    ("nvmlEventTypeSingleBitEccErrorStorm", 0x200, "ecc_single_bit_storm"),
    ("nvmlEventTypeDramRetirementEvent", 0x400, "dram_retirement"),
    ("nvmlEventTypeDramRetirementFailure", 0x800, "dram_retirement_failure"),
    ("nvmlEventTypeNonFatalPoisonError", 0x1000, "poison_non_fatal"),
    ("nvmlEventTypeFatalPoisonError", 0x2000, "poison_fatal"),
    ("nvmlEventTypeGpuUnavailableError", 0x4000, "gpu_unavailable"),
)
"""(binding constant, bit, our name) of the event types worth waking a soak engineer for."""

_NVML_ERROR_TIMEOUT = 10

XID_NAMES: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing (often a killed process)",
    45: "preemptive cleanup (a process ended)",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link error",
    140: "unrecovered ECC error",
}
"""What the common XIDs mean (NVIDIA's XID catalogue), for the annotation text."""

BENIGN_XIDS = frozenset({43, 45})
"""XIDs a process ending (an engine restart, a killed request) raises: reported, not alarming."""


@dataclass(frozen=True, slots=True)
class GpuEvent:
    """One event the driver reported."""

    gpu: int
    kind: str
    """Our name of the event type (`xid`, `ecc_double_bit`, ...)."""
    data: int
    """The XID number for `xid`; the event's data word otherwise."""
    wall_ns: int


class GpuEventListener:
    """Collector `gpu_events`: a thread waiting on an NVML event set for every GPU.

    `start()` launches the thread; `collect` turns what arrived since the previous call into events
    (through `on_event(kind, message, **fields)`) and one `gpu_events` point per GPU with the counts
    of the interval (zeros too, so an alert has a series). `stop()`/`close()` end the thread.
    When NVML cannot deliver events (no permission, a vGPU, an old driver), `available` is False and
    `reason` says why; the soak goes on without it.
    """

    name = "gpu_events"

    def __init__(
        self,
        nvml: Any,
        gpus: Sequence[int],
        on_event: EventFn,
        wait_ms: int = 500,
        wall_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self._nvml = nvml
        self._gpus = list(gpus)
        self._on_event = on_event
        self._wait_ms = wait_ms
        self._wall_ns = wall_ns
        self._lock = threading.Lock()
        self._pending: list[GpuEvent] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = False
        self.reason = ""
        self.registered: dict[int, list[str]] = {}
        """GPU -> the event kinds it was registered for."""
        self.totals: dict[str, int] = {}
        """Events seen over the run, by kind (and `xid_<n>` by XID)."""
        self.seen: list[dict[str, FieldValue]] = []
        """Every event of the run (bounded: the first 1000), for the summary."""

    def start(self, timeout_s: float = 5.0) -> bool:
        """Start the thread and wait until it has registered (or failed); True when listening."""
        self._thread = threading.Thread(target=self._run, name="soakd-nvml-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            self.reason = f"event registration did not finish within {timeout_s:g} s"
        return self.available

    def _run(self) -> None:
        nv = self._nvml
        err_type = nv.NVMLError
        try:
            nv.nvmlInit()
        except err_type as err:
            self._give_up(f"nvmlInit: {err}")
            return
        event_set: Any = None
        try:
            event_set = nv.nvmlEventSetCreate()
            handles = {}
            for i in self._gpus:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                handles[i] = h
                try:
                    supported = int(nv.nvmlDeviceGetSupportedEventTypes(h))
                except err_type:
                    supported = 0
                wanted = [(getattr(nv, const, bit), name) for const, bit, name in _EVENT_TYPES]
                mask = 0
                names: list[str] = []
                for bit, name in wanted:
                    if supported & bit:
                        mask |= bit
                        names.append(name)
                if mask:
                    nv.nvmlDeviceRegisterEvents(h, mask, event_set)
                    self.registered[i] = names
            if not self.registered:
                self._give_up("no GPU supports the error event types")
                return
            self.available = True
            log.info("gpu_events_listening", gpus={str(k): v for k, v in self.registered.items()})
            self._ready.set()
            index = _Indexer(nv, handles)
            kinds = {getattr(nv, const, bit): name for const, bit, name in _EVENT_TYPES}
            while not self._stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(event_set, self._wait_ms)
                except err_type as err:
                    if getattr(err, "value", None) == _NVML_ERROR_TIMEOUT:
                        continue
                    # Anything else (GPU lost, driver gone) ends listening; said once.
                    log.warning("gpu_events_wait_failed", error=str(err))
                    self.available = False
                    self.reason = f"nvmlEventSetWait_v2: {err}"
                    return
                ev = GpuEvent(
                    gpu=index(data.device),
                    kind=kinds.get(int(data.eventType), f"type_{int(data.eventType):#x}"),
                    data=int(data.eventData),
                    wall_ns=self._wall_ns(),
                )
                with self._lock:
                    self._pending.append(ev)
        except err_type as err:
            self._give_up(str(err))
        finally:
            if event_set is not None:
                with contextlib.suppress(err_type):
                    nv.nvmlEventSetFree(event_set)
            with contextlib.suppress(err_type):
                nv.nvmlShutdown()
            self._ready.set()

    def _give_up(self, reason: str) -> None:
        self.available = False
        self.reason = reason
        log.warning("gpu_events_unavailable", reason=reason)
        self._ready.set()

    def collect(self, now_ns: int) -> Sequence[Sample]:
        with self._lock:
            events, self._pending = self._pending, []
        counts = {i: 0 for i in self.registered}
        for ev in events:
            counts[ev.gpu] = counts.get(ev.gpu, 0) + 1
            self._report(ev)
        return [
            Sample("gpu_events", {"errors": n}, now_ns, tags={"gpu": str(gpu)}) for gpu, n in counts.items()
        ]

    def _report(self, ev: GpuEvent) -> None:
        fields: dict[str, FieldValue] = {"gpu": ev.gpu, "event": ev.kind, "data": ev.data}
        self.totals[ev.kind] = self.totals.get(ev.kind, 0) + 1
        if ev.kind == "xid":
            meaning = XID_NAMES.get(ev.data, "see NVIDIA's XID catalogue")
            fields["xid"] = ev.data
            fields["benign"] = ev.data in BENIGN_XIDS
            key = f"xid_{ev.data}"
            self.totals[key] = self.totals.get(key, 0) + 1
            self._on_event("gpu_xid", f"GPU {ev.gpu}: XID {ev.data} ({meaning})", **fields)
        else:
            self._on_event("gpu_error", f"GPU {ev.gpu}: {ev.kind} (data {ev.data:#x})", **fields)
        if len(self.seen) < 1000:
            self.seen.append({**fields, "wall_ns": ev.wall_ns})

    def summary(self) -> dict[str, object]:
        xids = sum(n for k, n in self.totals.items() if k == "xid")
        benign = sum(n for k, n in self.totals.items() if k.startswith("xid_") and int(k[4:]) in BENIGN_XIDS)
        return {
            "listening": self.available,
            "reason": self.reason,
            "registered": {str(k): v for k, v in self.registered.items()},
            "totals": dict(sorted(self.totals.items())),
            "xid_errors": xids - benign,
            "xid_benign": benign,
            "events": self.seen,
        }

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self) -> None:
        self.stop()


class _Indexer:
    """The GPU index of an event's device handle (compared by address; asked of NVML otherwise)."""

    def __init__(self, nv: Any, handles: dict[int, Any]) -> None:
        self._nv = nv
        self._by_key = {_key(h): i for i, h in handles.items()}

    def __call__(self, handle: Any) -> int:
        found = self._by_key.get(_key(handle))
        if found is not None:
            return found
        try:
            return int(self._nv.nvmlDeviceGetIndex(handle))
        except self._nv.NVMLError:
            return -1


def _key(handle: Any) -> object:
    # A ctypes pointer's identity is the address it holds; fakes compare by value.
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle
