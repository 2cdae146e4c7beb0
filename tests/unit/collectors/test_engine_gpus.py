"""A parallel engine's GPUs: which ones it runs on (CUDA_VISIBLE_DEVICES read as CUDA reads it), the
config that cannot fit refused with its key and line, and the straggler judged on a two-GPU recording
made from an H200's (one GPU capped by a shared load, the other not)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from soakd.collectors.engine_gpus import (
    check_parallel,
    engine_gpus,
    for_config,
    recorded_uuids,
    visible_gpus,
)
from soakd.collectors.gpu_throttle import GpuThrottleWatch
from soakd.config import load
from soakd.errors import ConfigError
from soakd.metric import Sample

UUIDS = (
    "GPU-c511bdc7-a71e-2132-5c94-314c9553998c",
    "GPU-0f3e9a11-0000-1111-2222-333344445555",
    None,
    "GPU-0f3e",
)
MATRIX = Path(__file__).parents[2] / "data" / "h200" / "matrix2" / "pays-advice"


@pytest.mark.parametrize(
    ("env", "want"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("1,0", [1, 0]),
        (" 2 , 3 ", [2, 3]),
        ("1gpu,2ampere", [1, 2]),  # strtoul: the digits an entry starts with
        ("1,7,0", [1]),  # no GPU 7: the list ends there
        ("1,-1,0", [1]),  # a negative entry ends it too
        ("0,zzz,1", [0]),
        ("1,1,0", []),  # an index given twice: no GPU at all
        ("GPU-c511bdc7", [0]),  # a unique prefix is enough
        ("GPU-c511bdc7-a71e-2132-5c94-314c9553998c,GPU-0f3e9a11", [0, 1]),
        ("GPU-c511bdc7,1", [0]),  # a UUID list ends at the first entry without the prefix
        ("GPU-0f3e", []),  # two GPUs start so: ambiguous, no GPU at all
        ("GPU-ffff,GPU-c511bdc7", []),  # no such GPU: the list ends there
        ("GPU-c511bdc7,GPU-c511bdc7", []),  # named twice
        ("c511bdc7", []),  # without the prefix: not a UUID, and no index either
        ("gpu-c511bdc7", []),  # the prefix is case-sensitive
    ],
)
def test_visible_gpus_reads_the_variable_as_cuda_does(env: str | None, want: list[int]) -> None:
    """CUDA's rules as PyTorch mirrors them (torch.cuda._parse_visible_devices and
    _transform_uuid_to_ordinals)."""
    assert visible_gpus(env, UUIDS) == want


def test_mig_instances_leave_the_engines_gpus_unknown() -> None:
    assert visible_gpus("MIG-5c1e0f0a-aaaa-bbbb-cccc-dddddddddddd", UUIDS) is None
    found = engine_gpus(2, 1, UUIDS, "MIG-5c1e0f0a")
    assert not found.known and found.gpus == (0, 1, 2, 3) and "MIG" in found.found_by
    assert found.replicas == () and found.to_dict()["replicas"] == []


def test_replicas_are_consecutive_groups_of_the_visible_gpus() -> None:
    found = engine_gpus(2, 2, (*UUIDS, "GPU-e", "GPU-f"), "5,4,3,2,1", order="PCI_BUS_ID")
    assert found.gpus == (5, 4, 3, 2) and found.replicas == ((5, 4), (3, 2))
    assert (
        found.to_dict()["replicas"] == [[5, 4], [3, 2]] and found.found_by == "CUDA_VISIBLE_DEVICES=5,4,3,2,1"
    )
    # Indices under CUDA's default order: taken in NVML's, and said so.
    assert "CUDA_DEVICE_ORDER is not PCI_BUS_ID" in engine_gpus(2, 1, UUIDS, "1,0").found_by
    # Pipeline parallelism counts in a replica's GPUs, as vLLM's device map has it.
    piped = engine_gpus(1, 2, UUIDS, None, pipeline_parallel=2)
    assert piped.replicas == ((0, 1), (2, 3)) and piped.per_replica == 2
    with pytest.raises(ConfigError, match="x pipeline_parallel_size 2 x data_parallel_size 3 needs 6"):
        engine_gpus(1, 3, UUIDS, None, pipeline_parallel=2)


def test_a_parallel_engine_that_cannot_fit_is_refused_with_its_key_and_line(tmp_path: Path) -> None:
    path = tmp_path / "soak.toml"
    path.write_text('[run]\nname = "tp"\n\n[engine]\nmodel = "m"\ntensor_parallel_size = 4\n')
    cfg = load(path)
    with pytest.raises(ConfigError) as err:
        for_config(cfg, UUIDS[:2], {"CUDA_VISIBLE_DEVICES": "1,0"})
    text = str(err.value)
    assert text.startswith(f"{path}:6: engine.tensor_parallel_size: ") and "needs 4 GPUs" in text
    assert "CUDA_VISIBLE_DEVICES=1,0 (indices taken" in text and "leaves 2 of 2 (1, 0)" in text
    assert "\n" not in text
    # From the command line: no file line to name, the key still.
    cfg = load(None, {"engine.data_parallel_size": 3})
    with pytest.raises(ConfigError, match=r"^engine.data_parallel_size: .*needs 3 GPUs"):
        for_config(cfg, UUIDS[:2], {})


def test_one_gpu_asked_and_none_visible_judges_every_gpu() -> None:
    found = engine_gpus(1, 1, UUIDS[:2], "")
    assert not found.known and found.gpus == (0, 1)


def test_a_servers_own_environment_wins_and_a_remote_engine_has_no_gpus_here() -> None:
    cfg = load(
        None,
        {
            "engine.kind": "vllm-server",
            "engine.tensor_parallel_size": 2,
            "engine.server.env": {"CUDA_VISIBLE_DEVICES": "3,1"},
        },
    )
    found = for_config(cfg, UUIDS, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert found is not None and found.gpus == (3, 1)
    remote = load(None, {"engine.kind": "openai", "engine.url": "http://x", "engine.tensor_parallel_size": 8})
    assert for_config(remote, UUIDS, {}) is None


@pytest.mark.parametrize(
    ("toml", "line", "key"),
    [
        ("extra_args = { tensor_parallel_size = 2 }", 3, "engine.extra_args.tensor_parallel_size"),
        (
            "[[engine.changes]]\nat = '1h'\nextra_args = { data_parallel_size = 2 }",
            5,
            "engine.changes.extra_args",
        ),
        ("[engine.server]\nextra_flags = ['--tensor-parallel-size', '2']", 4, "engine.server.extra_flags"),
        ("[engine.server]\nextra_flags = ['-dp=2']", 4, "engine.server.extra_flags"),
    ],
)
def test_parallelism_given_another_way_is_refused_for_the_first_class_key(
    tmp_path: Path, toml: str, line: int, key: str
) -> None:
    path = tmp_path / "soak.toml"
    path.write_text(f"[engine]\nmodel = 'm'\n{toml}\n")
    with pytest.raises(
        ConfigError, match=rf":{line}: {key}.*: set engine\.(tensor|data)_parallel_size instead"
    ):
        load(path)


def two_gpu_recording(src: Path, dst: Path, start: float, end: float) -> Path:
    """The H200 recording as two GPUs of one engine: GPU 1 as recorded (capped by the load from
    `start` to `end`, wall seconds), GPU 0 as if the load had not been on it (its clock and reasons
    outside the load, its first busy sample's, held over the load)."""
    with gzip.open(src, "rt") as f:
        header = json.loads(f.readline())
        rows = [json.loads(line) for line in f]
    g0 = dict(header["header"]["gpus"][0])
    header["header"]["gpus"] = [{**g0, "uuid": "GPU-00000000-aaaa"}, g0]
    calm: dict[str, Any] = {}
    for row in rows:
        g = row["gpus"][0]
        t = row["wall_ns"] / 1e9
        if not start <= t <= end + 2:
            calm = {k: g[k] for k in ("sm_mhz", "reasons", "power_mw") if k in g}
        other = {**g, **calm} if start <= t <= end + 2 else dict(g)
        other.pop("fields", None)  # no throttle-time counters: GPU 0 was never capped
        if "fields" in g:
            other["fields"] = {k: 0 for k in g["fields"]}
        row["gpus"] = [other, g]
    with gzip.open(dst, "wt") as f:
        f.write(json.dumps(header) + "\n")
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return dst


def load_span() -> tuple[float, float]:
    times = json.loads((MATRIX / "times.json").read_text())
    return float(times["load_start"]), float(times["load_end"])


def rows(path: Path) -> Iterator[tuple[float, list[dict[str, Any]]]]:
    with gzip.open(path, "rt") as f:
        f.readline()
        for line in f:
            row = json.loads(line)
            yield row["wall_ns"] / 1e9, row["gpus"]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    start, end = load_span()
    return two_gpu_recording(
        MATRIX / "nvml.jsonl.gz", tmp_path_factory.mktemp("rec") / "two.jsonl.gz", start, end
    )


def test_the_straggler_is_named_and_its_harm_is_the_engines(recording: Path) -> None:
    """Tensor parallel over the two GPUs, the shared load on GPU 1 only: harm on GPU 1 within 3 s of the
    load (none on GPU 0), the engine's harm while it lasts with the evidence naming GPU 1, and the
    `gpu_spread` points naming GPU 1 the straggler through the load, none outside it."""
    start, end = load_span()
    assert recorded_uuids(recording, load(None, {})) == (
        "GPU-00000000-aaaa",
        "GPU-c511bdc7-a71e-2132-5c94-314c9553998c",
    )
    events: list[tuple[float, str, dict[str, Any]]] = []
    now = [0.0]
    watch = GpuThrottleWatch(
        {0: 1980.0, 1: 1980.0},
        lambda kind, _msg, **f: events.append((now[0], kind, f)),
        groups={"0": (0, 1)},
    )
    slow: dict[int, dict[str, Any]] = {0: {}, 1: {}}
    points: list[tuple[float, Sample]] = []
    sources: set[str] = set()
    last = None
    for t, gpus in rows(recording):
        now[0] = t
        for i, g in enumerate(gpus):
            if g.get("fields") is not None:
                slow[i] = g
            watch.observe(i, t, g, slow[i])
        if watch.harm():
            sources.add(watch.harm_source(watch.harm()))
            assert watch.harm_source("thermal") == ""  # harm of another kind (the host's) is not GPU 1's
        if last is None or t - last >= 1.0:
            points += [(t, p) for p in watch.collect(int(t * 1e9)) if p.measurement == "gpu_spread"]
            last = t
    harm = [(t, k, f) for t, k, f in events if k.startswith("harm_")]
    assert [(k, f["gpu"]) for _, k, f in harm] == [("harm_enter", 1), ("harm_leave", 1)]
    assert 0 < harm[0][0] - start < 3.0 and 0 < harm[1][0] - end < 30.0
    assert sources == {"GPU 1"}
    under = [p for t, p in points if start + 3 <= t <= end]
    outside = [p for t, p in points if t < start - 1 or t > end + 15]
    assert under and all(p.fields["straggler"] == 1 for p in under)
    assert all(float(p.fields["sm_spread"]) > 0.1 for p in under)  # 16-18 % of the clock lost on GPU 1
    assert outside and all(p.fields["straggler"] == -1 for p in outside)
    assert all(p.tags == {"group": "0"} and p.fields["gpus"] == 2 for _, p in points)
    summary = watch.spread_summary()["0"]
    assert isinstance(summary, dict) and summary["straggler"] == 1 and summary["gpus"] == [0, 1]
    assert summary["straggler_intervals"] == summary["intervals_with_a_straggler"] >= len(under)


def test_a_gpu_outside_the_engine_is_recorded_but_not_judged(recording: Path) -> None:
    """The engine on GPU 0 alone (CUDA_VISIBLE_DEVICES=0): the load on GPU 1 is another tenant's, no
    harm for this engine, and no spread to take with one GPU."""
    events: list[str] = []
    watch = GpuThrottleWatch({0: 1980.0}, lambda kind, _msg, **f: events.append(kind), groups={"0": (0,)})
    for t, gpus in rows(recording):
        for i, g in enumerate(gpus):
            watch.observe(i, t, g, g if g.get("fields") is not None else {})
    assert "harm_enter" not in events and watch.spread_summary() == {}
    assert [p.tags["gpu"] for p in watch.collect(0)] == ["0"]


def test_check_parallel_reads_a_recordings_gpus(recording: Path, tmp_path: Path) -> None:
    ok = load(None, {"engine.tensor_parallel_size": 2, "telemetry.gpu_recording": str(recording)})
    check_parallel(ok, {})
    path = tmp_path / "soak.toml"
    path.write_text(
        "[engine]\ndata_parallel_size = 2\ntensor_parallel_size = 2\n"
        f"[telemetry]\ngpu_recording = '{recording}'\n"
    )
    with pytest.raises(ConfigError, match=r":3: engine.tensor_parallel_size: .*needs 4 GPUs"):
        check_parallel(load(path), {})
    check_parallel(load(None, {"engine.tensor_parallel_size": 1}), {})  # one GPU: nothing to probe
    # Pipeline parallelism alone (in extra_args) needs its GPUs too: refused here, not when the run is made.
    piped = load(
        None, {"engine.extra_args": {"pipeline_parallel_size": 4}, "telemetry.gpu_recording": str(recording)}
    )
    with pytest.raises(ConfigError, match=r"^engine.extra_args.pipeline_parallel_size: .*needs 4 GPUs"):
        check_parallel(piped, {})
    missing = tmp_path / "missing.jsonl.gz"
    bad = load(None, {"engine.tensor_parallel_size": 2, "telemetry.gpu_recording": str(missing)})
    with pytest.raises(
        ConfigError, match=r"^telemetry.gpu_recording: .*missing.jsonl.gz: not an NVML recording"
    ):
        check_parallel(bad, {})


def test_an_idle_gpu_is_no_straggler() -> None:
    """Two data-parallel replicas, one idle: its clock at the floor says nothing of who is slow."""
    watch = GpuThrottleWatch({0: 1980.0, 1: 1980.0}, lambda *_a, **_f: None, groups={"all": (0, 1)})
    for k in range(10):
        watch.observe(0, k / 10, {"sm_mhz": 1980, "reasons": 0}, {"util_gpu": 90})
        watch.observe(1, k / 10, {"sm_mhz": 345, "reasons": 0x1}, {"util_gpu": 0})
    assert [p for p in watch.collect(1) if p.measurement == "gpu_spread"] == []
    for k in range(10):
        watch.observe(0, 1 + k / 10, {"sm_mhz": 1980, "reasons": 0}, {"util_gpu": 90})
        watch.observe(1, 1 + k / 10, {"sm_mhz": 1900, "reasons": 0}, {"util_gpu": 90})
    (point,) = [p for p in watch.collect(2) if p.measurement == "gpu_spread"]
    assert point.fields["straggler"] == 1 and point.tags == {"group": "all"}


def test_the_engine_is_started_parallel_and_a_one_gpu_config_keeps_its_id() -> None:
    """vLLM gets tensor/data parallelism from the first-class keys (in-process and as server flags);
    a one-GPU engine's arguments, and so its config id, are what they were before the keys existed."""
    from soakd.engine.vllm_local import config_id, engine_kwargs
    from soakd.engine.vllm_server import server_argv

    one = load(None, {}).engine
    assert not {"tensor_parallel_size", "data_parallel_size"} & set(engine_kwargs(one, "m"))
    both = load(None, {"engine.tensor_parallel_size": 2, "engine.data_parallel_size": 2}).engine
    kwargs = engine_kwargs(both, "m")
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["data_parallel_size"] == 2
    assert config_id(kwargs) != config_id(engine_kwargs(one, "m"))
    argv = server_argv(both, "m", 8000)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
