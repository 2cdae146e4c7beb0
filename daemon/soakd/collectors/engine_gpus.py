"""Which GPUs the engine runs on: CUDA_VISIBLE_DEVICES read the way CUDA reads it, mapped onto NVML's
indices, and the first tensor x data parallel of them taken, one replica per tensor-parallel group (vLLM
gives data-parallel rank r the r-th group of `tensor_parallel_size` devices).

CUDA's rules, followed here: unset means every GPU; an entry is an index or a UUID (`GPU-...`, a unique
prefix of it is enough); the list ends at the first entry that names no GPU, or names one a second time,
and whatever follows is ignored. An index is CUDA's, which is NVML's (PCI bus) order when
CUDA_DEVICE_ORDER=PCI_BUS_ID, and on a node of one GPU model otherwise: a UUID is exact everywhere. MIG
instances (`MIG-...`) are not GPUs soakd can tell apart by NVML index: with one, the engine's GPUs are
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
    tensor_parallel: int
    data_parallel: int
    found_by: str
    """"CUDA_VISIBLE_DEVICES=..." or "all GPUs" (unset), or why they could not be told ("MIG ...")."""
    known: bool = True
    """False when the engine's GPUs could not be told: then `gpus` is every GPU."""

    @property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """Each data-parallel replica's GPUs (its tensor-parallel group)."""
        tp = self.tensor_parallel
        if not self.known:
            return (self.gpus,)
        return tuple(self.gpus[r * tp : (r + 1) * tp] for r in range(self.data_parallel))

    def replica_of(self, gpu: int) -> int | None:
        for r, group in enumerate(self.replicas):
            if gpu in group:
                return r
        return None

    def to_dict(self) -> dict[str, object]:
        return {
            "gpus": list(self.gpus),
            "replicas": [list(g) for g in self.replicas],
            "tensor_parallel_size": self.tensor_parallel,
            "data_parallel_size": self.data_parallel,
            "found_by": self.found_by,
            "known": self.known,
        }


def _norm(uuid: str) -> str:
    return uuid.strip().lower().removeprefix("gpu-")


def visible_gpus(env: str | None, uuids: Sequence[str | None]) -> list[int] | None:
    """NVML indices of the GPUs CUDA makes visible, in CUDA's order (its device 0 first); None when an
    entry is a MIG instance (no NVML index names it)."""
    count = len(uuids)
    if env is None:
        return list(range(count))
    out: list[int] = []
    for raw in env.split(","):
        entry = raw.strip()
        if entry.upper().startswith("MIG-"):
            return None
        index: int | None = None
        if entry.isdigit() or (entry[:1] in "+-" and entry[1:].isdigit()):
            n = int(entry)
            index = n if 0 <= n < count else None
        elif entry:
            want = _norm(entry)
            hits = [i for i, u in enumerate(uuids) if u is not None and want and _norm(u).startswith(want)]
            index = hits[0] if len(hits) == 1 else None
        if index is None or index in out:
            break  # CUDA ignores the rest of the list from here
        out.append(index)
    return out


def engine_gpus(
    tensor_parallel: int,
    data_parallel: int,
    uuids: Sequence[str | None],
    env: str | None,
    *,
    where: tuple[str | None, int | None] = (None, None),
) -> EngineGpus:
    """The engine's GPUs among the NVML devices with these UUIDs. Bad input (exit 2): fewer visible GPUs
        than a parallel engine needs; the error names the config key and where it was set (`where`: the
    file and line, the environment variable, nothing for the command line)."""
    visible = visible_gpus(env, uuids)
    found_by = "all GPUs (CUDA_VISIBLE_DEVICES unset)" if env is None else f"CUDA_VISIBLE_DEVICES={env}"
    if visible is None:
        return EngineGpus(
            tuple(range(len(uuids))),
            tensor_parallel,
            data_parallel,
            f"{found_by}: MIG instances have no GPU index, every GPU judged",
            known=False,
        )
    need = tensor_parallel * data_parallel
    if len(visible) < need and need == 1:
        # One GPU asked, none visible to CUDA: a CPU engine on a GPU host, or a device list soakd cannot
        # read; the engine's own start says which. Nothing to refuse: every GPU judged, as before.
        return EngineGpus(
            tuple(range(len(uuids))), 1, 1, f"{found_by}: no GPU visible, every GPU judged", known=False
        )
    if len(visible) < need:
        file, line = where
        shown = ", ".join(map(str, visible)) or "none"
        raise ConfigError(
            f"tensor_parallel_size {tensor_parallel} x data_parallel_size {data_parallel} needs {need} GPUs; "
            f"{found_by} leaves {len(visible)} of {len(uuids)} ({shown})",
            file=file,
            line=line,
            key="engine.tensor_parallel_size" if tensor_parallel > 1 else "engine.data_parallel_size",
        )
    return EngineGpus(tuple(visible[:need]), tensor_parallel, data_parallel, found_by)


def engine_visible_env(cfg: Config, environ: Mapping[str, str]) -> str | None:
    """CUDA_VISIBLE_DEVICES as the engine starts with it: a server's own `engine.server.env` wins over
    the environment soakd inherited (the in-process engine and a server both inherit it)."""
    if cfg.engine.kind == "vllm-server" and "CUDA_VISIBLE_DEVICES" in cfg.engine.server.env:
        return cfg.engine.server.env["CUDA_VISIBLE_DEVICES"]
    return environ.get("CUDA_VISIBLE_DEVICES")


def for_config(cfg: Config, uuids: Sequence[str | None], environ: Mapping[str, str]) -> EngineGpus | None:
    """The engine's GPUs among these NVML devices; None for an engine elsewhere (`engine.kind =
    "openai"`: the GPUs here need not be its). Raises ConfigError when a parallel engine cannot fit."""
    if cfg.engine.kind == "openai":
        return None
    e = cfg.engine
    key = "engine.tensor_parallel_size" if e.tensor_parallel_size > 1 else "engine.data_parallel_size"
    return engine_gpus(
        e.tensor_parallel_size,
        e.data_parallel_size,
        uuids,
        engine_visible_env(cfg, environ),
        where=cfg.where(key),
    )


def recorded_uuids(path: Path) -> tuple[str | None, ...]:
    """The GPUs of an NVML recording (its header line), for a run that plays one instead of NVML."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            header = json.loads(f.readline()).get("header", {})
    except (OSError, ValueError, AttributeError):
        return ()  # the recording's own reader says what is wrong with it, in words of its own
    return tuple(g.get("uuid") if isinstance(g, dict) else None for g in header.get("gpus", []))


def check_parallel(cfg: Config, environ: Mapping[str, str]) -> None:
    """Refuse, before anything is written, a parallel engine that the GPUs here cannot hold (exit 2)."""
    e = cfg.engine
    if e.tensor_parallel_size * e.data_parallel_size <= 1 or e.kind == "openai":
        return
    recording = cfg.telemetry.gpu_recording
    if recording:
        uuids = recorded_uuids(cfg.resolve(recording))
    else:
        probe = probe_nvml()
        if probe.count == 0:
            key = "engine.tensor_parallel_size" if e.tensor_parallel_size > 1 else "engine.data_parallel_size"
            file, line = cfg.where(key)
            raise ConfigError(
                f"a parallel engine needs {e.tensor_parallel_size * e.data_parallel_size} GPUs; "
                f"none found ({probe.reason or 'NVML sees no GPU'})",
                file=file,
                line=line,
                key=key,
            )
        uuids = probe.uuids
    for_config(cfg, uuids, environ)
