"""Which GPUs the engine runs on: CUDA_VISIBLE_DEVICES read the way CUDA reads it, mapped onto NVML's
indices, and the first tensor x pipeline x data parallel of them taken, one replica per group of tensor
x pipeline parallel devices (vLLM gives data-parallel rank r the r-th such group).

CUDA's rules, as PyTorch mirrors them (torch.cuda._parse_visible_devices): unset means every GPU. A value
that starts with `GPU-` is a list of UUIDs (a unique prefix of one is enough; the list ends at the first
entry without the prefix or matching no GPU; one matching two GPUs, or an entry given twice, makes the
whole list empty). Otherwise a list of indices, each read as strtoul reads it (`1gpu` is 1); it ends at
the first negative or unreadable entry, or one past the GPUs there are; an index given twice makes it
empty. An index is CUDA's, NVML's (PCI bus) order only under CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA's default,
fastest first, agrees on a node of one GPU model): `found_by` says which was assumed; a UUID is exact.
MIG instances (`MIG-...`) are not GPUs soakd can tell apart by NVML index: with one, the engine's GPUs are
unknown and every GPU is judged, said in the run's meta."""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from soakd.collectors.gpu import probe_nvml
from soakd.config import Config
from soakd.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineGpus:
    """The engine's GPUs by NVML index, in the engine's rank order, and how they were found."""

    gpus: tuple[int, ...]
    per_replica: int
    """GPUs per data-parallel replica: tensor x pipeline parallel."""
    data_parallel: int
    found_by: str
    """"CUDA_VISIBLE_DEVICES=..." or "all GPUs" (unset), or why they could not be told ("MIG ...")."""
    known: bool = True
    """False when the engine's GPUs could not be told: then `gpus` is every GPU, and no replica is known."""

    @property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """Each data-parallel replica's GPUs (none when the engine's GPUs are unknown)."""
        if not self.known:
            return ()
        n = self.per_replica
        return tuple(self.gpus[r * n : (r + 1) * n] for r in range(self.data_parallel))

    def to_dict(self) -> dict[str, object]:
        return {
            "gpus": list(self.gpus),
            "replicas": [list(g) for g in self.replicas],
            "gpus_per_replica": self.per_replica,
            "data_parallel_size": self.data_parallel,
            "found_by": self.found_by,
            "known": self.known,
        }


def _strtoul(entry: str) -> int:
    """The integer an entry starts with, as strtoul reads it (sign allowed first); -1 when none."""
    digits = 0
    for k, c in enumerate(entry):
        if not (c.isdigit() or (k == 0 and c in "+-")):
            break
        digits = k + 1
    try:
        return int(entry[:digits]) if digits else -1
    except ValueError:  # a sign alone
        return -1


def visible_gpus(env: str | None, uuids: Sequence[str | None]) -> list[int] | None:
    """NVML indices of the GPUs CUDA makes visible, in CUDA's order (its device 0 first); None when the
    list names MIG instances (no NVML index names one)."""
    count = len(uuids)
    if env is None:
        return list(range(count))
    if env.startswith("MIG-"):
        return None
    out: list[int] = []
    if env.startswith("GPU-"):
        seen: list[str] = []
        for entry in env.split(","):
            if entry in seen:
                return []
            if not entry.startswith("GPU-"):
                break
            seen.append(entry)
            hits = [i for i, u in enumerate(uuids) if u is not None and u.startswith(entry)]
            if len(hits) > 1:
                return []  # ambiguous: CUDA sees no device at all
            if not hits:
                break
            out.append(hits[0])
        return out
    for entry in env.split(","):
        n = _strtoul(entry.strip())
        if n in out:
            return []
        if n < 0 or n >= count:
            break
        out.append(n)
    return out


def engine_gpus(
    tensor_parallel: int,
    data_parallel: int,
    uuids: Sequence[str | None],
    env: str | None,
    *,
    pipeline_parallel: int = 1,
    order: str | None = None,
    key: str = "engine.tensor_parallel_size",
    where: tuple[str | None, int | None] = (None, None),
) -> EngineGpus:
    """The engine's GPUs among the NVML devices with these UUIDs (`env`: CUDA_VISIBLE_DEVICES, `order`:
    CUDA_DEVICE_ORDER). Bad input (exit 2): fewer visible GPUs than a parallel engine needs; the error
    names the config key that made it parallel and where it was set (`where`: the file and line, the
    environment variable, nothing for the command line)."""
    group = tensor_parallel * pipeline_parallel
    visible = visible_gpus(env, uuids)
    found_by = "all GPUs (CUDA_VISIBLE_DEVICES unset)" if env is None else f"CUDA_VISIBLE_DEVICES={env}"
    if visible is None:
        return EngineGpus(
            tuple(range(len(uuids))),
            group,
            1,
            f"{found_by}: MIG instances have no GPU index, every GPU judged",
            known=False,
        )
    if env is not None and not env.startswith("GPU-") and order != "PCI_BUS_ID":
        found_by += " (indices taken in NVML's order: CUDA_DEVICE_ORDER is not PCI_BUS_ID)"
    need = group * data_parallel
    if len(visible) < need and need == 1:
        # One GPU asked, none visible to CUDA: a CPU engine on a GPU host, or a device list soakd cannot
        # read; the engine's own start says which. Nothing to refuse: every GPU judged, as before.
        return EngineGpus(
            tuple(range(len(uuids))), 1, 1, f"{found_by}: no GPU visible, every GPU judged", known=False
        )
    if len(visible) < need:
        file, line = where
        shown = ", ".join(map(str, visible)) or "none"
        pp = f" x pipeline_parallel_size {pipeline_parallel}" if pipeline_parallel > 1 else ""
        raise ConfigError(
            f"tensor_parallel_size {tensor_parallel}{pp} x data_parallel_size {data_parallel} needs {need} "
            f"GPUs; {found_by} leaves {len(visible)} of {len(uuids)} ({shown})",
            file=file,
            line=line,
            key=key,
        )
    return EngineGpus(tuple(visible[:need]), group, data_parallel, found_by)


def _engine_env(cfg: Config, environ: Mapping[str, str], name: str) -> str | None:
    """A variable as the engine starts with it: a server's own `engine.server.env` wins over the
    environment soakd inherited (the in-process engine and a server both inherit it)."""
    if cfg.engine.kind == "vllm-server" and name in cfg.engine.server.env:
        return cfg.engine.server.env[name]
    return environ.get(name)


def for_config(cfg: Config, uuids: Sequence[str | None], environ: Mapping[str, str]) -> EngineGpus | None:
    """The engine's GPUs among these NVML devices; None for an engine elsewhere (`engine.kind =
    "openai"`: the GPUs here need not be its). Raises ConfigError when a parallel engine cannot fit."""
    if cfg.engine.kind == "openai":
        return None
    e = cfg.engine
    return engine_gpus(
        e.tensor_parallel_size,
        e.data_parallel_size,
        uuids,
        _engine_env(cfg, environ, "CUDA_VISIBLE_DEVICES"),
        pipeline_parallel=e.pipeline_parallel_size,
        order=_engine_env(cfg, environ, "CUDA_DEVICE_ORDER"),
        key=e.parallel_key,
        where=cfg.where(e.parallel_key),
    )


def recorded_uuids(path: Path, cfg: Config) -> tuple[str | None, ...]:
    """The GPUs of an NVML recording (its header line), for a run that plays one instead of NVML."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        header = json.loads(first)["header"]
        gpus = header["gpus"]
        if not isinstance(gpus, list):
            raise TypeError("gpus is not a list")
    except (OSError, ValueError, KeyError, TypeError) as err:
        file, line = cfg.where("telemetry.gpu_recording")
        raise ConfigError(
            f"{path}: not an NVML recording with a header ({err})",
            file=file,
            line=line,
            key="telemetry.gpu_recording",
        ) from None
    return tuple(g.get("uuid") if isinstance(g, dict) else None for g in gpus)


def check_parallel(cfg: Config, environ: Mapping[str, str]) -> None:
    """Refuse, before anything is written, a parallel engine that the GPUs here cannot hold (exit 2).
    With no GPU here at all nothing is refused: vLLM's CPU build runs tensor parallel too."""
    e = cfg.engine
    if e.gpus_needed <= 1 or e.kind == "openai":
        return
    recording = cfg.telemetry.gpu_recording
    if recording:
        uuids = recorded_uuids(cfg.resolve(recording), cfg)
    else:
        probe = probe_nvml()
        if probe.count == 0:
            return
        uuids = probe.uuids
    for_config(cfg, uuids, environ)
