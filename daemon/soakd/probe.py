"""`soakd probe`: know the ceiling before a soak. A hardware profile per GPU and a decode ceiling per model.

Decode is memory-bandwidth bound: every generated token reads (about) all the weights and the KV cache of
its context once. So tokens/s can be no more than bandwidth / bytes read per token. A soak running near
that ceiling has little left to tune; one far below it points at scheduling or kernels.

The profile comes from NVML (the module is injectable: `probe(nvml_module=fake)`) and, where torch with
CUDA is importable, from `torch.cuda.get_device_properties` (SM count, L2 size) plus an optional measured
device-to-device copy bandwidth. Every reading a GPU or binding does not support is None; nothing here
raises on a machine without NVML, a driver or a GPU: the document says why instead, and still reports
the model's bytes per token.

The model's weight bytes are summed from the safetensors headers (an 8-byte little-endian length, then
a JSON table of tensors with their byte offsets), so nothing is loaded; for dummy weights (a shape folder
without weights) they are the parameters counted from config.json (soakd.shapes.param_count).

Over 500 lines because the hardware profile, the model's bytes and the decode ceiling are one calculation
with its sources (NVML, config.json, safetensors headers).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from soakd.shapes import dtype_bytes as shape_dtype_bytes
from soakd.shapes import is_shape_dir, param_count, text_config

log = structlog.get_logger(__name__)

COPY_BYTES = 1 << 30
"""Size of the tensor copied device-to-device by the bandwidth measurement (1 GiB)."""
COPY_ITERATIONS = 10
_MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is not a safetensors file

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}
"""Bytes per element of the dtype names a config.json (or a KV-cache dtype) may carry."""


# -- bandwidth ---------------------------------------------------------------------------------------


def theoretical_bandwidth_gbs(bus_width_bits: int | None, mem_clock_mhz: int | None) -> float | None:
    """Peak memory bandwidth, GB/s (1e9 bytes/s), from NVML's bus width and maximum memory clock.

    bytes/s = bus_width_bits / 8 * mem_clock_hz * 2: data moves on both clock edges (DDR). For HBM the
    clock NVML reports is the one this formula wants: an H100 SXM (5120-bit, 2619 MHz) gives 3352 GB/s,
    its published 3.35 TB/s. The H200 (HBM3e) is published at 4.8 TB/s. Its NVML maximum memory clock
    is 3201 MHz; an assumed 5120-bit bus would give only 4097 GB/s (15% short), but NVML on an H200
    (driver 580.159.04) reports a 6016-bit bus: 4814 GB/s, within 0.3% of the published figure. A
    1 GiB device-to-device copy reached 4245 GB/s there (88%). The figure is only as right as NVML's
    two numbers; the measured copy is the more honest ceiling. None when either input is unknown.
    """
    if not bus_width_bits or not mem_clock_mhz:
        return None
    return bus_width_bits / 8 * mem_clock_mhz * 1e6 * 2 / 1e9


# -- hardware profile --------------------------------------------------------------------------------


@dataclass(slots=True)
class HardwareProfile:
    """What bounds one GPU's decode speed. Each reading is None when unsupported or unknown."""

    index: int
    """NVML index (PCI bus order), not necessarily the CUDA index."""
    name: str | None = None
    uuid: str | None = None
    sm_count: int | None = None
    """Streaming multiprocessors, from torch (NVML has no portable call for it)."""
    memory_total_bytes: int | None = None
    memory_bus_width_bits: int | None = None
    max_mem_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    theoretical_bandwidth_gbs: float | None = None
    """bus width / 8 * max memory clock * 2, GB/s: see `theoretical_bandwidth_gbs()`."""
    l2_cache_bytes: int | None = None
    """From torch's device properties."""
    pcie_gen_current: int | None = None
    """Current link generation: drops while the GPU idles (power saving), so compare with the max."""
    pcie_width_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    power_limit_w: float | None = None
    """Enforced power limit."""
    compute_capability: str | None = None
    """"major.minor", from NVML, else torch."""
    driver_version: str | None = None
    measured_copy_bandwidth_gbs: float | None = None
    """Device-to-device copy: (read + write bytes) / time, GB/s. None when not measured."""
    copy_note: str | None = None
    """Why the copy was not measured, when it was not."""

    def best_bandwidth_gbs(self) -> tuple[float, str] | None:
        """The bandwidth a ceiling should use, and which one it is: measured, else theoretical."""
        if self.measured_copy_bandwidth_gbs:
            return self.measured_copy_bandwidth_gbs, "measured_copy"
        if self.theoretical_bandwidth_gbs:
            return self.theoretical_bandwidth_gbs, "theoretical"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Nvml:
    """Calls into an NVML module where any NVMLError, or a function the binding lacks, becomes None."""

    def __init__(self, nvml: Any) -> None:
        self.nv = nvml
        self.error: type[BaseException] = nvml.NVMLError

    def call(self, fn_name: str, *args: Any) -> Any:
        fn = getattr(self.nv, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.error:
            return None

    def const(self, name: str, default: int) -> int:
        return int(getattr(self.nv, name, default))


def _text(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return str(v)


def _int(v: Any) -> int | None:
    return None if v is None else int(v)


def _nvml_profile(n: _Nvml, index: int, driver: str | None) -> HardwareProfile:
    h = n.call("nvmlDeviceGetHandleByIndex", index)
    p = HardwareProfile(index=index, driver_version=driver)
    if h is None:
        return p
    p.name = _text(n.call("nvmlDeviceGetName", h))
    p.uuid = _text(n.call("nvmlDeviceGetUUID", h))
    mem = n.call("nvmlDeviceGetMemoryInfo", h)
    p.memory_total_bytes = None if mem is None else int(mem.total)
    p.memory_bus_width_bits = _int(n.call("nvmlDeviceGetMemoryBusWidth", h))
    p.max_mem_clock_mhz = _int(n.call("nvmlDeviceGetMaxClockInfo", h, n.const("NVML_CLOCK_MEM", 2)))
    p.max_sm_clock_mhz = _int(n.call("nvmlDeviceGetMaxClockInfo", h, n.const("NVML_CLOCK_SM", 1)))
    p.theoretical_bandwidth_gbs = theoretical_bandwidth_gbs(p.memory_bus_width_bits, p.max_mem_clock_mhz)
    p.pcie_gen_current = _int(n.call("nvmlDeviceGetCurrPcieLinkGeneration", h))
    p.pcie_width_current = _int(n.call("nvmlDeviceGetCurrPcieLinkWidth", h))
    p.pcie_gen_max = _int(n.call("nvmlDeviceGetMaxPcieLinkGeneration", h))
    p.pcie_width_max = _int(n.call("nvmlDeviceGetMaxPcieLinkWidth", h))
    limit_mw = n.call("nvmlDeviceGetEnforcedPowerLimit", h)
    p.power_limit_w = None if limit_mw is None else int(limit_mw) / 1000.0
    cc = n.call("nvmlDeviceGetCudaComputeCapability", h)
    if cc is not None:
        p.compute_capability = f"{int(cc[0])}.{int(cc[1])}"
    return p


def _torch_cuda(torch_module: Any) -> tuple[Any | None, str | None]:
    """(torch, None) when torch with a usable CUDA device is there, else (None, why not)."""
    torch = torch_module
    if torch is None:
        try:
            import torch as imported
        except ImportError:
            return None, "torch is not installed"
        torch = imported
    try:
        if not torch.cuda.is_available():
            return None, "torch sees no CUDA device"
    except Exception as err:  # noqa: BLE001 - a broken CUDA install must not break the probe
        return None, f"torch.cuda failed: {err}"
    return torch, None


def _norm_uuid(u: Any) -> str:
    s = str(u).lower()
    return s.removeprefix("gpu-")


def _torch_props(torch: Any) -> list[Any]:
    out: list[Any] = []
    try:
        for i in range(int(torch.cuda.device_count())):
            out.append(torch.cuda.get_device_properties(i))
    except Exception:  # noqa: BLE001
        return out
    return out


def _cuda_index(profile: HardwareProfile, props: list[Any], nvml_count: int) -> int | None:
    """The CUDA index of an NVML GPU: matched by UUID (CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER can
    reorder or hide GPUs), else by index when both sides see the same number of GPUs."""
    if profile.uuid is not None:
        want = _norm_uuid(profile.uuid)
        for i, pr in enumerate(props):
            u = getattr(pr, "uuid", None)
            if u is not None and _norm_uuid(u) == want:
                return i
        if any(getattr(pr, "uuid", None) is not None for pr in props):
            return None
    if len(props) == nvml_count and profile.index < len(props):
        return profile.index
    return None


def _fill_from_torch(p: HardwareProfile, pr: Any) -> None:
    sm = getattr(pr, "multi_processor_count", None)
    p.sm_count = _int(sm)
    l2 = getattr(pr, "L2_cache_size", None)
    p.l2_cache_bytes = _int(l2) if l2 else None
    if p.compute_capability is None and getattr(pr, "major", None) is not None:
        p.compute_capability = f"{int(pr.major)}.{int(pr.minor)}"
    if p.name is None:
        p.name = _text(getattr(pr, "name", None))
    if p.memory_total_bytes is None:
        p.memory_total_bytes = _int(getattr(pr, "total_memory", None))


def measure_copy_bandwidth_gbs(
    torch: Any, cuda_index: int, nbytes: int = COPY_BYTES, iterations: int = COPY_ITERATIONS
) -> float:
    """Time `iterations` device-to-device copies of an `nbytes` tensor with CUDA events after a warm-up;
    GB/s counting both the bytes read and the bytes written (2 * nbytes per copy), as STREAM's copy does.

    A copy reaches a large share of, never all of, the peak: compare it with the theoretical figure.
    """
    dev = torch.device("cuda", cuda_index)
    with torch.cuda.device(dev):
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        try:
            for _ in range(2):
                dst.copy_(src)
            torch.cuda.synchronize(dev)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iterations):
                dst.copy_(src)
            end.record()
            end.synchronize()
            ms = float(start.elapsed_time(end))
        finally:
            del src, dst
            torch.cuda.empty_cache()
    return 2 * nbytes * iterations / (ms / 1e3) / 1e9


def hardware_profiles(
    nvml_module: Any = None, torch_module: Any = None, measure_copy: bool = True, use_torch: bool = True
) -> tuple[list[HardwareProfile], dict[str, Any]]:
    """Profiles of every GPU NVML sees, and a status dict: `nvml_available`, `reason` (why there are no
    profiles, else None), `driver_version`, `cuda_driver_version`, `torch_note`. Never raises.

    `use_torch=False` keeps to NVML: no CUDA context in this process (the daemon, whose GPU memory
    belongs to the engine), so no SM count, L2 size or measured copy."""
    status: dict[str, Any] = {
        "nvml_available": False,
        "reason": None,
        "driver_version": None,
        "cuda_driver_version": None,
        "torch_note": None,
    }
    nv = nvml_module
    if nv is None:
        try:
            import pynvml as imported
        except ImportError:
            status["reason"] = "pynvml (nvidia-ml-py) is not installed"
            return [], status
        nv = imported
    n = _Nvml(nv)
    try:
        nv.nvmlInit()
    except n.error as err:
        status["reason"] = f"NVML could not start (no NVIDIA driver or GPU?): {err}"
        return [], status
    except OSError as err:
        status["reason"] = f"NVML library could not be loaded: {err}"
        return [], status
    try:
        status["nvml_available"] = True
        driver = _text(n.call("nvmlSystemGetDriverVersion"))
        status["driver_version"] = driver
        status["cuda_driver_version"] = _int(n.call("nvmlSystemGetCudaDriverVersion"))
        count = _int(n.call("nvmlDeviceGetCount")) or 0
        if count == 0:
            status["reason"] = "NVML sees no GPU"
            return [], status
        profiles = [_nvml_profile(n, i, driver) for i in range(count)]
    finally:
        n.call("nvmlShutdown")

    if not use_torch:
        status["torch_note"] = "torch not used"
        return profiles, status
    torch, why = _torch_cuda(torch_module)
    status["torch_note"] = why
    props = _torch_props(torch) if torch is not None else []
    for p in profiles:
        ci = _cuda_index(p, props, count)
        if ci is None:
            p.copy_note = why or "GPU not visible to CUDA"
            continue
        _fill_from_torch(p, props[ci])
        if not measure_copy:
            p.copy_note = "copy measurement switched off"
            continue
        try:
            p.measured_copy_bandwidth_gbs = measure_copy_bandwidth_gbs(torch, ci)
        except Exception as err:  # noqa: BLE001 - out of memory, a busy GPU: report, go on
            p.copy_note = f"copy measurement failed: {err}"
    return profiles, status


# -- model bytes and the decode ceiling ----------------------------------------------------------------


def safetensors_bytes(path: Path) -> int:
    """Sum of the tensor byte sizes in one safetensors file, from its header alone (end - start of each
    tensor's `data_offsets`). Raises ValueError when the file is not safetensors."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {length} is not plausible")
        raw = f.read(length)
    if len(raw) != length:
        raise ValueError(f"{path}: header truncated")
    try:
        table = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: header is not JSON: {err}") from err
    total = 0
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        total += int(end) - int(start)
    return total


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """What one decode step reads of a model: its weights once, and each sequence's KV cache."""

    model_dir: str
    weight_bytes: int
    """The weights' bytes, from the source `source` names."""
    kv_bytes_per_token: int | None
    """layers * 2 (K and V) * KV heads * head_dim * KV dtype bytes; None when config.json lacks them."""
    num_hidden_layers: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    kv_dtype_bytes: int | None = None
    files: list[str] = field(default_factory=list)
    source: str = "safetensors"
    """"safetensors" (the sum of the tensor sizes over the folder's *.safetensors headers) or "config"
    (parameters counted from config.json times its dtype's bytes: a shape folder, or dummy weights)."""
    load_format: str = "auto"
    params: int | None = None
    """Parameters counted from config.json; None when it is not a dense decoder's."""
    safetensors_bytes: int | None = None
    config_bytes: int | None = None
    """params * the config's dtype bytes."""
    weights_disagree: bool = False
    """True when both are known and differ by more than WEIGHTS_TOLERANCE of the larger."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


WEIGHTS_TOLERANCE = 0.10
"""Relative difference between the safetensors bytes and the config's count above which soakd warns."""


def _config_int(cfg: dict[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def model_bytes(
    model_dir: Path, kv_dtype_bytes: int | None = None, *, load_format: str = "auto"
) -> ModelBytes:
    """Weight bytes and KV-cache bytes per token of context (from config.json; multimodal configs nest it
    under `text_config`). `kv_dtype_bytes` overrides the KV element size (an fp8 KV cache is 1); by
    default it is the model's dtype, 2 when unknown.

    The weights come from the safetensors headers, unless the engine loads dummy weights (`load_format`
    "dummy", or a shape folder: `soakd model shape`): then it allocates the config's shapes, so the
    parameters counted from config.json times the dtype's bytes are what it reads. With both at hand a
    difference of more than 10 % is logged and flagged (`weights_disagree`).

    Raises FileNotFoundError when the folder has no *.safetensors file and is not loaded with dummy
    weights, ValueError for a bad header or (dummy weights) a config that cannot be counted.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    dummy = load_format == "dummy" or is_shape_dir(model_dir)
    if not files and not dummy:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    cfg: dict[str, Any] = {}
    cfg_path = model_dir / "config.json"
    if cfg_path.is_file():
        cfg = text_config(json.loads(cfg_path.read_text(encoding="utf-8")))
    try:
        params: int | None = param_count(cfg)
    except ValueError:
        if dummy:
            raise
        params = None
    config_bytes = None if params is None else params * shape_dtype_bytes(cfg)
    st_bytes = sum(safetensors_bytes(p) for p in files) if files else None
    disagree = False
    if config_bytes is not None and st_bytes is not None:
        disagree = abs(config_bytes - st_bytes) > WEIGHTS_TOLERANCE * max(config_bytes, st_bytes)
        if disagree:
            log.warning(
                "weights_disagree",
                model_dir=str(model_dir),
                safetensors_bytes=st_bytes,
                config_bytes=config_bytes,
                used="config" if dummy else "safetensors",
            )
    if dummy:
        assert config_bytes is not None  # param_count raised otherwise
        weights, source = config_bytes, "config"
    else:
        assert st_bytes is not None
        weights, source = st_bytes, "safetensors"
    layers = _config_int(cfg, "num_hidden_layers")
    heads = _config_int(cfg, "num_attention_heads")
    kv_heads = _config_int(cfg, "num_key_value_heads") or heads
    head_dim = _config_int(cfg, "head_dim")
    hidden = _config_int(cfg, "hidden_size")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    if kv_dtype_bytes is None:
        dtype = cfg.get("dtype") or cfg.get("torch_dtype")
        kv_dtype_bytes = DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 2)
    kv = None
    if layers and kv_heads and head_dim:
        kv = layers * 2 * kv_heads * head_dim * kv_dtype_bytes
    return ModelBytes(
        model_dir=str(model_dir),
        weight_bytes=weights,
        kv_bytes_per_token=kv,
        num_hidden_layers=layers,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype_bytes=kv_dtype_bytes,
        files=[p.name for p in files],
        source=source,
        load_format="dummy" if dummy else load_format,
        params=params,
        safetensors_bytes=st_bytes,
        config_bytes=config_bytes,
        weights_disagree=disagree,
    )


def tokens_per_s_ceiling(
    weight_bytes: int,
    kv_bytes_per_token: int | None,
    bandwidth_gbs: float,
    batch: int = 1,
    context_tokens: int = 0,
) -> float:
    """Decode tokens/s no engine can beat on `bandwidth_gbs`, summed over a batch.

    One decode step reads the weights once and each of the `batch` sequences' KV cache for
    `context_tokens` tokens, and yields `batch` tokens:

        tokens/s = batch * bandwidth / (weights + batch * kv_per_token * context_tokens)

    Batch 1 is bandwidth / (weights + kv_per_token * context). Assumptions: every weight byte is read
    once per step (true for dense models; an MoE reads only its active experts, so this understates its
    ceiling; an untied input-embedding table is read one row per token, so it overstates the bytes by
    that table); the KV write of the new token, activations and the sampler are ignored; caches (L2)
    hold none of the weights; compute and launch overheads are free. Speculative decoding (MTP) can pass
    this ceiling by accepting several tokens per weight read.
    """
    if bandwidth_gbs <= 0:
        raise ValueError("bandwidth must be positive")
    if batch < 1:
        raise ValueError("batch must be >= 1")
    kv = (kv_bytes_per_token or 0) * context_tokens * batch
    return batch * bandwidth_gbs * 1e9 / (weight_bytes + kv)


@dataclass(frozen=True, slots=True)
class DecodeCeiling:
    bandwidth_gbs: float
    batch: int
    context_tokens: int
    bytes_per_step: int
    """Weights + batch * KV per token * context."""
    tokens_per_s: float
    """Summed over the batch."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_ceiling(
    model_dir: Path | ModelBytes,
    bandwidth_gbs: float,
    batch: int = 1,
    context_tokens: int = 0,
    kv_dtype_bytes: int | None = None,
) -> DecodeCeiling:
    """The decode ceiling of a model folder (or its `ModelBytes`) on a bandwidth: see
    `tokens_per_s_ceiling` for the formula and its assumptions."""
    mb = model_dir if isinstance(model_dir, ModelBytes) else model_bytes(model_dir, kv_dtype_bytes)
    kv = mb.kv_bytes_per_token or 0
    return DecodeCeiling(
        bandwidth_gbs=bandwidth_gbs,
        batch=batch,
        context_tokens=context_tokens,
        bytes_per_step=mb.weight_bytes + batch * kv * context_tokens,
        tokens_per_s=tokens_per_s_ceiling(
            mb.weight_bytes, mb.kv_bytes_per_token, bandwidth_gbs, batch, context_tokens
        ),
    )


# -- the probe document --------------------------------------------------------------------------------


def probe(
    nvml_module: Any = None,
    torch_module: Any = None,
    model_dir: Path | None = None,
    measure_copy: bool = True,
    batches: Iterable[int] = (1,),
    context_tokens: Iterable[int] = (0, 2048),
    load_format: str = "auto",
) -> dict[str, Any]:
    """Everything `soakd probe` reports, JSON-able. Never raises.

    Keys: `gpus` (HardwareProfile dicts), `nvml_available`, `reason` (why no GPU was profiled, else
    None), `driver_version`, `cuda_driver_version`, `torch_note`, `model` (ModelBytes dict, or
    {"model_dir", "error"}; absent without `model_dir`), `ceilings` (per GPU x batch x context: the
    DecodeCeiling fields plus `gpu` and `bandwidth_source`, measured copy else theoretical).
    """
    profiles, status = hardware_profiles(nvml_module, torch_module, measure_copy)
    doc: dict[str, Any] = {"gpus": [p.to_dict() for p in profiles], **status}
    if model_dir is None:
        return doc
    try:
        mb = model_bytes(model_dir, load_format=load_format)
    except (OSError, ValueError, KeyError, TypeError) as err:
        doc["model"] = {"model_dir": str(model_dir), "error": str(err)}
        return doc
    doc["model"] = mb.to_dict()
    ceilings: list[dict[str, Any]] = []
    for p in profiles:
        best = p.best_bandwidth_gbs()
        if best is None:
            continue
        bw, source = best
        for b in batches:
            for ctx in context_tokens:
                c = decode_ceiling(mb, bw, batch=b, context_tokens=ctx).to_dict()
                ceilings.append({"gpu": p.index, "bandwidth_source": source, **c})
    doc["ceilings"] = ceilings
    return doc


def _fmt(v: Any, unit: str = "", scale: float = 1.0, digits: int = 0) -> str:
    if v is None:
        return "n/a"
    return f"{v / scale:,.{digits}f}{unit}"


def _weights_source(model: dict[str, Any]) -> str:
    if model.get("source") == "config":
        params = model.get("params")
        why = "dummy weights" if model.get("files") else "no weights in the folder: dummy weights"
        return f"config.json: {_fmt(params, 'B params', 1e9, 2)} x dtype bytes ({why})"
    return f"the safetensors headers ({len(model.get('files') or [])} files)"


def probe_lines(doc: dict[str, Any]) -> list[str]:
    """Human-readable lines of a `probe()` document, for the CLI."""
    lines: list[str] = []
    if doc.get("reason"):
        lines.append(f"no GPU profile: {doc['reason']}")
    if doc.get("driver_version"):
        lines.append(f"driver {doc['driver_version']}, CUDA driver API {doc.get('cuda_driver_version')}")
    for g in doc.get("gpus", []):
        lines.append(f"GPU {g['index']}: {g.get('name') or 'unknown'} ({g.get('uuid') or 'no uuid'})")
        lines.append(
            f"  compute capability {g.get('compute_capability') or 'n/a'}, SMs {_fmt(g.get('sm_count'))}, "
            f"max SM clock {_fmt(g.get('max_sm_clock_mhz'), ' MHz')}, "
            f"L2 {_fmt(g.get('l2_cache_bytes'), ' MiB', 1 << 20, 1)}"
        )
        lines.append(
            f"  memory {_fmt(g.get('memory_total_bytes'), ' GiB', 1 << 30, 1)}, "
            f"bus {_fmt(g.get('memory_bus_width_bits'), ' bit')}, "
            f"max memory clock {_fmt(g.get('max_mem_clock_mhz'), ' MHz')}"
        )
        measured = g.get("measured_copy_bandwidth_gbs")
        copy = _fmt(measured, " GB/s") if measured is not None else f"not measured ({g.get('copy_note')})"
        lines.append(
            f"  bandwidth: theoretical {_fmt(g.get('theoretical_bandwidth_gbs'), ' GB/s')}, copy {copy}"
        )
        lines.append(
            f"  PCIe gen {_fmt(g.get('pcie_gen_current'))} x{_fmt(g.get('pcie_width_current'))} now, "
            f"gen {_fmt(g.get('pcie_gen_max'))} x{_fmt(g.get('pcie_width_max'))} max; "
            f"power limit {_fmt(g.get('power_limit_w'), ' W')}"
        )
    if doc.get("torch_note") and doc.get("gpus"):
        lines.append(f"torch: {doc['torch_note']}")
    model = doc.get("model")
    if model is not None:
        if "error" in model:
            lines.append(f"model {model['model_dir']}: {model['error']}")
        else:
            kv = model.get("kv_bytes_per_token")
            lines.append(
                f"model {model['model_dir']}: weights {_fmt(model['weight_bytes'], ' MB', 1e6, 1)} "
                f"read per decode step, KV cache {_fmt(kv, ' KiB', 1024, 1)} per token of context"
            )
            lines.append(f"  weights from {_weights_source(model)}")
            if model.get("weights_disagree"):
                lines.append(
                    f"  warning: safetensors hold {_fmt(model.get('safetensors_bytes'), ' MB', 1e6, 1)}, "
                    f"the config counts {_fmt(model.get('config_bytes'), ' MB', 1e6, 1)} "
                    f"(more than {WEIGHTS_TOLERANCE:.0%} apart)"
                )
            l2 = max((g.get("l2_cache_bytes") or 0 for g in doc.get("gpus", [])), default=0)
            if model["weight_bytes"] <= l2:
                lines.append("  the weights fit in L2: the bandwidth ceiling below does not bind")
        for c in doc.get("ceilings", []):
            lines.append(
                f"  GPU {c['gpu']} ceiling at batch {c['batch']}, context {c['context_tokens']}: "
                f"{c['tokens_per_s']:,.0f} tokens/s ({c['bandwidth_source']} "
                f"{c['bandwidth_gbs']:,.0f} GB/s)"
            )
    return lines
