"""A vLLM worker extension that reports the worker's memory allocator state to soakd.

vLLM mixes `SoakdWorkerExtension` into its worker class when the engine is started with
`worker_extension_cls="soakd.engine.worker_ext.SoakdWorkerExtension"` (AsyncEngineArgs) or
`--worker-extension-cls soakd.engine.worker_ext.SoakdWorkerExtension` (api_server); soakd then calls
`collective_rpc("soakd_memory_stats")` and gets one dict per worker.

The result crosses vLLM's RPC (msgpack between engine core and workers, JSON on the dev-mode HTTP
endpoint), so it holds plain ints, floats and strs only: a torch dtype or tensor in a result crashed
the engine core's output thread. vLLM refuses an extension whose attribute names clash with the
worker's, so the mixin carries exactly one method; the logic lives in module-level functions.

torch is imported inside the method: soakd itself imports without torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any

StatValue = int | float | str


def request_amx() -> bool:
    """Ask Linux for AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, through torch) where the CPU has it.

    vLLM's CPU attention kernel uses AMX tiles on such CPUs, and the kernel lets a process use them only
    after it asked; vLLM 0.32 never asks, oneDNN does when it first runs an AMX matmul. A worker whose
    first step is small (a short prompt) reaches attention before any such matmul and dies of SIGILL
    (seen on a Xeon with amx_bf16). vLLM calls it as a general plugin in each process it starts (also
    servers soakd did not launch, where soakd is installed), and it runs when vLLM imports this module
    into a worker (a source tree on PYTHONPATH has no entry points); a no-op where torch is not loaded
    (soakd's own process outside an engine) or the CPU has no AMX."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    cpu = getattr(torch, "cpu", None)
    supported = getattr(cpu, "_is_amx_tile_supported", None)
    init = getattr(cpu, "_init_amx", None)
    if supported is None or init is None or not supported():
        return False
    return bool(init())


request_amx()

# torch.cuda.memory_stats() key -> soakd field. All are byte counts or event counters (ints).
CUDA_STAT_KEYS: dict[str, str] = {
    "allocated_bytes.all.current": "allocated_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "active_bytes.all.current": "active_bytes",
    "inactive_split_bytes.all.current": "inactive_split_bytes",
    "allocated_bytes.all.peak": "allocated_bytes_peak",
    "reserved_bytes.all.peak": "reserved_bytes_peak",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
    "num_device_alloc": "num_device_alloc",
    "num_device_free": "num_device_free",
}


def cuda_fields(
    stats: Mapping[str, Any], free_bytes: int | None = None, total_bytes: int | None = None
) -> dict[str, StatValue]:
    """soakd's fields from a `torch.cuda.memory_stats()` dict and `mem_get_info()` (pure).

    Keys the running torch does not report are simply absent. Derived ratios (floats):
    `fragmentation` = 1 - allocated/reserved, the share of the caching allocator's reserved segments
    not backing a live tensor; `inactive_split_ratio` = inactive_split/reserved, the share held by
    split blocks that cannot be returned to the driver. Both only when reserved > 0.
    """
    out: dict[str, StatValue] = {}
    for key, name in CUDA_STAT_KEYS.items():
        value = stats.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = int(value)
    if free_bytes is not None:
        out["device_free_bytes"] = int(free_bytes)
    if total_bytes is not None:
        out["device_total_bytes"] = int(total_bytes)
    reserved = out.get("reserved_bytes")
    if isinstance(reserved, int) and reserved > 0:
        allocated = out.get("allocated_bytes")
        if isinstance(allocated, int):
            out["fragmentation"] = 1.0 - allocated / reserved
        inactive = out.get("inactive_split_bytes")
        if isinstance(inactive, int):
            out["inactive_split_ratio"] = inactive / reserved
    return out


def _identity(worker: Any) -> dict[str, StatValue]:
    out: dict[str, StatValue] = {"pid": os.getpid()}
    for attr in ("rank", "local_rank"):
        value = getattr(worker, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out[attr] = value
    return out


def _cuda_device(worker: Any) -> Any | None:
    """The worker's torch.device when it is a CUDA device and CUDA is usable, else None."""
    device = getattr(worker, "device", None)
    if getattr(device, "type", None) != "cuda":
        return None
    torch: Any = importlib.import_module("torch")
    return device if bool(torch.cuda.is_available()) else None


def memory_stats(worker: Any) -> dict[str, StatValue]:
    """What `SoakdWorkerExtension.soakd_memory_stats` returns for `worker` (a vLLM worker instance)."""
    out = _identity(worker)
    device = _cuda_device(worker)
    if device is not None:
        torch: Any = importlib.import_module("torch")
        stats = torch.cuda.memory_stats(device)
        free, total = torch.cuda.mem_get_info(device)
        out.update(cuda_fields(stats, int(free), int(total)))
        out["source"] = "cuda_allocator"
        return out
    # CPU build: torch's CPU allocator keeps no statistics like the CUDA caching allocator, so the
    # real signal is the worker process's own footprint. memory_info() is one read of
    # /proc/PID/statm; memory_full_info() (USS) would parse smaps and is far slower.
    import psutil

    mem = psutil.Process().memory_info()
    out["rss_bytes"] = int(mem.rss)
    out["vms_bytes"] = int(mem.vms)
    out["source"] = "worker_rss"
    return out


class SoakdWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `device`, `rank`, `local_rank`)."""

    def soakd_memory_stats(self) -> dict[str, int | float | str]:
        """This worker's allocator state: plain ints/floats/strs only (they cross vLLM's RPC)."""
        return memory_stats(self)
