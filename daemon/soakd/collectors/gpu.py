"""Whether this machine has NVIDIA GPUs NVML can read (the GPU collector itself needs one)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class GpuProbe:
    """NVML's answer: how many GPUs, the driver, or why NVML is unusable."""

    count: int
    driver: str = ""
    reason: str = ""
    uuids: tuple[str | None, ...] = field(default=())
    """Each GPU's UUID by NVML index (None where NVML would not say): how CUDA_VISIBLE_DEVICES is read."""


def probe_nvml() -> GpuProbe:
    """Ask NVML for the GPU count; a machine without the library or a GPU gives count 0 and the reason."""
    try:
        import pynvml
    except ImportError as err:
        return GpuProbe(0, reason=f"nvidia-ml-py not installed ({err})")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return GpuProbe(0, reason=f"NVML unavailable: {err}")
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = int(pynvml.nvmlDeviceGetCount())
        uuids: list[str | None] = []
        for i in range(count):
            try:
                raw = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                uuids.append(raw.decode() if isinstance(raw, bytes) else str(raw))
            except pynvml.NVMLError:
                uuids.append(None)
        return GpuProbe(count, driver=str(driver), uuids=tuple(uuids))
    except pynvml.NVMLError as err:
        return GpuProbe(0, reason=f"NVML error: {err}")
    finally:
        pynvml.nvmlShutdown()
