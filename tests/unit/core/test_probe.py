"""`soakd probe`: the hardware profile over a fake pynvml (and a fake torch), the bandwidth formula, the
decode ceiling over hand-written and real (tinymodel) safetensors folders, and the no-GPU path."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from soakd.probe import (
    ModelBytes,
    decode_ceiling,
    hardware_profiles,
    model_bytes,
    probe,
    probe_lines,
    safetensors_bytes,
    theoretical_bandwidth_gbs,
    tokens_per_s_ceiling,
)
from soakd.testing import H200_UUID, FakeNvml


class FakeTorch:
    """torch.cuda with device properties; no copy is ever measured through it (tests pass
    measure_copy=False or check the failure path)."""

    def __init__(self, available: bool = True, uuid: str = H200_UUID.removeprefix("GPU-")) -> None:
        props = SimpleNamespace(
            name="NVIDIA H200",
            multi_processor_count=132,
            L2_cache_size=60 * 1024 * 1024,
            major=9,
            minor=0,
            total_memory=150_754_820_096,
            uuid=uuid,
        )
        self.cuda = SimpleNamespace(
            is_available=lambda: available,
            device_count=lambda: 1 if available else 0,
            get_device_properties=lambda i: props,
        )

    def device(self, *args: Any) -> Any:
        raise RuntimeError("no device in the fake")


class OldBindingNvml(FakeNvml):
    nvmlDeviceGetCudaComputeCapability = None  # a binding without the call


# -- hardware profile --------------------------------------------------------------------------------


def test_profile_fields_from_nvml_and_torch() -> None:
    nv = FakeNvml(name_bytes=True)  # old bindings return bytes
    profiles, status = hardware_profiles(nv, FakeTorch(), measure_copy=False)
    assert status["nvml_available"] and status["reason"] is None and nv.shutdown
    assert status["driver_version"] == "580.159.04" and status["cuda_driver_version"] == 13000
    (p,) = profiles
    assert p.name == "NVIDIA H200" and p.uuid == H200_UUID
    assert p.sm_count == 132 and p.l2_cache_bytes == 60 << 20
    assert p.memory_total_bytes == 150_754_820_096
    assert p.memory_bus_width_bits == 5120 and p.max_mem_clock_mhz == 3201 and p.max_sm_clock_mhz == 1980
    assert p.theoretical_bandwidth_gbs == pytest.approx(4097.28)
    assert (p.pcie_gen_current, p.pcie_width_current, p.pcie_gen_max, p.pcie_width_max) == (5, 16, 5, 16)
    assert p.power_limit_w == 700.0 and p.compute_capability == "9.0"
    assert p.measured_copy_bandwidth_gbs is None and p.copy_note == "copy measurement switched off"
    assert p.best_bandwidth_gbs() == (pytest.approx(4097.28), "theoretical")
    json.dumps(p.to_dict())


def test_unsupported_readings_are_none() -> None:
    nv = OldBindingNvml(unsupported={"bus", "pcie", "power_limit"})
    (p,), _ = hardware_profiles(nv, FakeTorch(available=False), measure_copy=True)
    assert p.memory_bus_width_bits is None and p.theoretical_bandwidth_gbs is None
    assert p.pcie_gen_current is None and p.pcie_width_max is None and p.power_limit_w is None
    assert p.compute_capability is None and p.sm_count is None and p.l2_cache_bytes is None
    assert p.max_mem_clock_mhz == 3201  # the rest still reads
    assert p.copy_note == "torch sees no CUDA device"
    assert p.best_bandwidth_gbs() is None


def test_torch_gpu_matched_by_uuid_not_index() -> None:
    (p,), _ = hardware_profiles(FakeNvml(), FakeTorch(uuid="another-gpu"), measure_copy=False)
    assert p.sm_count is None and p.copy_note == "GPU not visible to CUDA"


def test_copy_failure_is_reported_not_raised() -> None:
    (p,), _ = hardware_profiles(FakeNvml(), FakeTorch(), measure_copy=True)
    assert p.measured_copy_bandwidth_gbs is None
    assert p.copy_note is not None and p.copy_note.startswith("copy measurement failed")
    assert p.sm_count == 132


def test_bandwidth_formula() -> None:
    # bus bits / 8 * MHz * 1e6 * 2 (DDR) / 1e9
    assert theoretical_bandwidth_gbs(5120, 2619) == pytest.approx(3352.32)  # H100 SXM: 3.35 TB/s published
    assert theoretical_bandwidth_gbs(5120, 3201) == pytest.approx(4097.28)  # H200 if the bus were 5120 bits
    # What NVML reports on a real H200 (driver 580.159.04): 6016 bits, 3201 MHz; published 4.8 TB/s.
    assert theoretical_bandwidth_gbs(6016, 3201) == pytest.approx(4814.304)
    assert theoretical_bandwidth_gbs(384, 10501) == pytest.approx(1008.096)  # RTX 4090 (GDDR6X)
    assert theoretical_bandwidth_gbs(None, 3201) is None and theoretical_bandwidth_gbs(5120, 0) is None


# -- no GPU ------------------------------------------------------------------------------------------


def test_no_driver_gives_reason_and_still_model_bytes(tmp_path: Path) -> None:
    model = _fake_model(tmp_path)
    doc = probe(nvml_module=FakeNvml(init_error=9), torch_module=FakeTorch(False), model_dir=model)
    assert doc["gpus"] == [] and not doc["nvml_available"]
    assert "NVML could not start" in doc["reason"]
    assert doc["model"]["weight_bytes"] == FAKE_WEIGHT_BYTES
    assert doc["ceilings"] == []
    json.dumps(doc)
    text = "\n".join(probe_lines(doc))
    assert "no GPU profile: NVML could not start" in text and "weights" in text


def test_zero_gpus_gives_reason() -> None:
    doc = probe(nvml_module=FakeNvml(count=0), torch_module=FakeTorch(False))
    assert doc["nvml_available"] and doc["reason"] == "NVML sees no GPU" and "model" not in doc


def test_missing_model_is_reported(tmp_path: Path) -> None:
    doc = probe(nvml_module=FakeNvml(count=0), model_dir=tmp_path / "nope")
    assert "no *.safetensors" in doc["model"]["error"]
    assert any("nope" in line for line in probe_lines(doc))


# -- model bytes and ceilings ------------------------------------------------------------------------

FAKE_TENSORS = {"embed.weight": ("BF16", [64, 32]), "layer.0.w": ("F32", [32, 16]), "norm": ("BF16", [32])}
FAKE_WEIGHT_BYTES = 64 * 32 * 2 + 32 * 16 * 4 + 32 * 2


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    size = {"BF16": 2, "F16": 2, "F32": 4, "I8": 1}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return offset


def _fake_model(root: Path) -> Path:
    d = root / "fake"
    d.mkdir()
    _write_safetensors(d / "model.safetensors", FAKE_TENSORS)
    cfg = {
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_model_bytes_from_headers(tmp_path: Path) -> None:
    d = _fake_model(tmp_path)
    _write_safetensors(d / "model-2.safetensors", {"extra": ("I8", [1000])})
    mb = model_bytes(d)
    assert mb.weight_bytes == FAKE_WEIGHT_BYTES + 1000
    assert mb.head_dim == 32  # hidden / heads, no head_dim key
    assert mb.kv_bytes_per_token == 3 * 2 * 2 * 32 * 2
    assert model_bytes(d, kv_dtype_bytes=1).kv_bytes_per_token == 3 * 2 * 2 * 32
    assert mb.files == ["model-2.safetensors", "model.safetensors"]


def test_bad_safetensors_raises_value_error(tmp_path: Path) -> None:
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="not plausible"):
        safetensors_bytes(p)
    p.write_bytes(b"abc")
    with pytest.raises(ValueError, match="too short"):
        safetensors_bytes(p)


def test_ceiling_formula() -> None:
    # The field notes' example: 256 GB/s over 8 GB of weights is 32 tokens/s.
    assert tokens_per_s_ceiling(8_000_000_000, None, 256.0) == pytest.approx(32.0)
    w, kv = 8_000_000_000, 131_072
    one = tokens_per_s_ceiling(w, kv, 256.0, batch=1, context_tokens=4096)
    assert one == pytest.approx(256e9 / (w + kv * 4096))
    eight = tokens_per_s_ceiling(w, kv, 256.0, batch=8, context_tokens=4096)
    assert eight == pytest.approx(8 * 256e9 / (w + 8 * kv * 4096))
    assert one < eight < 8 * one
    with pytest.raises(ValueError):
        tokens_per_s_ceiling(w, kv, 0.0)


def test_probe_document_with_gpu_and_model(tmp_path: Path) -> None:
    model = _fake_model(tmp_path)
    nv = FakeNvml(name_bytes=True)
    doc = probe(nv, FakeTorch(), model, measure_copy=False, batches=(1, 4), context_tokens=(0, 100))
    assert len(doc["ceilings"]) == 4
    first = doc["ceilings"][0]
    assert first["gpu"] == 0 and first["bandwidth_source"] == "theoretical"
    assert first["bytes_per_step"] == FAKE_WEIGHT_BYTES
    assert first["tokens_per_s"] == pytest.approx(4097.28e9 / FAKE_WEIGHT_BYTES)
    last = doc["ceilings"][-1]
    kv = doc["model"]["kv_bytes_per_token"]
    assert (last["batch"], last["context_tokens"]) == (4, 100)
    assert last["bytes_per_step"] == FAKE_WEIGHT_BYTES + 4 * kv * 100
    json.dumps(doc)
    text = "\n".join(probe_lines(doc))
    assert "GPU 0: NVIDIA H200" in text and "SMs 132" in text and "4,097 GB/s" in text
    assert "PCIe gen 5 x16 now" in text and "power limit 700 W" in text
    assert "ceiling at batch 4, context 100" in text
    assert "fit in L2" in text  # a few KB of weights against 60 MiB of L2


def test_decode_ceiling_over_the_real_tiny_model(tmp_path: Path) -> None:
    """The tiny Qwen3 built by soakd.tinymodel: bytes per token equal the tensors' total size."""
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from soakd.tinymodel import build_tiny_model

    d = build_tiny_model(tmp_path / "tiny")
    tensors = load_file(str(d / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    mb = model_bytes(d)
    assert isinstance(mb, ModelBytes) and mb.weight_bytes == total
    # Qwen3 tiny: 2 layers * (K, V) * 2 KV heads * head_dim 64 * bf16
    assert mb.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2
    c = decode_ceiling(d, 256.0)
    assert c.bytes_per_step == total and c.tokens_per_s == pytest.approx(256e9 / total)
    c8 = decode_ceiling(d, 256.0, batch=8, context_tokens=1024)
    assert c8.bytes_per_step == total + 8 * 1024 * mb.kv_bytes_per_token


# -- shape folders and dummy weights ----------------------------------------------------------------------


def _big_config() -> dict[str, Any]:
    from soakd.shapes import SHAPES

    return dict(SHAPES["qwen3-8b"].config)


def test_model_bytes_of_a_shape_folder_come_from_the_config(tmp_path: Path) -> None:
    from soakd.shapes import MARKER, param_count

    d = tmp_path / "shape"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_big_config()))
    (d / MARKER).write_text(json.dumps({"shape": "Qwen3-8B"}))
    mb = model_bytes(d)
    assert mb.source == "config"
    assert mb.load_format == "dummy"
    assert mb.params == param_count(_big_config())
    assert mb.weight_bytes == mb.params * 2
    assert mb.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    assert mb.safetensors_bytes is None and not mb.weights_disagree
    doc = probe(nvml_module=FakeNvml(), torch_module=None, model_dir=d, measure_copy=False)
    assert doc["model"]["source"] == "config"
    assert doc["ceilings"][0]["bytes_per_step"] == mb.weight_bytes
    text = "\n".join(probe_lines(doc))
    assert "weights from config.json: 8.19B params" in text


def test_disagreeing_safetensors_warn_and_dummy_takes_the_config(tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    d = _fake_model(tmp_path)  # tiny safetensors ...
    (d / "config.json").write_text(json.dumps(_big_config()))  # ... beside an 8B config
    with capture_logs() as logs:
        mb = model_bytes(d)
    assert mb.source == "safetensors" and mb.weight_bytes == FAKE_WEIGHT_BYTES
    assert mb.weights_disagree
    assert mb.config_bytes is not None and mb.config_bytes > 1e10
    warned = [e for e in logs if e["event"] == "weights_disagree"]
    assert warned and warned[0]["log_level"] == "warning" and warned[0]["used"] == "safetensors"
    # The engine allocates the config's shapes with dummy weights, whatever the files hold.
    with capture_logs() as logs:
        dummy = model_bytes(d, load_format="dummy")
    assert dummy.source == "config" and dummy.weight_bytes == dummy.config_bytes
    assert dummy.safetensors_bytes == FAKE_WEIGHT_BYTES and dummy.weights_disagree
    assert [e["used"] for e in logs if e["event"] == "weights_disagree"] == ["config"]
    doc = probe(nvml_module=FakeNvml(), model_dir=d, measure_copy=False, load_format="dummy")
    text = "\n".join(probe_lines(doc))
    assert "weights from config.json" in text and "warning: safetensors hold" in text


def test_agreeing_safetensors_do_not_warn(tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    d = _fake_model(tmp_path)
    cfg = {
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 4,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    for p in d.glob("*.safetensors"):
        p.unlink()
    # 4*8 embed + q/k/v/o 4*64 + mlp 3*128 + norms 2*8 + final 8 = 696 params, bf16
    _write_safetensors(d / "model.safetensors", {"all": ("BF16", [696])})
    with capture_logs() as logs:
        mb = model_bytes(d)
    assert mb.params == 696 and mb.config_bytes == mb.safetensors_bytes == mb.weight_bytes
    assert not mb.weights_disagree and not logs
    assert "weights from the safetensors headers (1 files)" in "\n".join(
        probe_lines({"gpus": [], "model": mb.to_dict()})
    )


def test_dummy_without_a_countable_config_is_an_error(tmp_path: Path) -> None:
    d = _fake_model(tmp_path)  # its config has no intermediate_size or vocab_size
    with pytest.raises(ValueError, match="intermediate_size"):
        model_bytes(d, load_format="dummy")
    assert model_bytes(d).params is None  # the safetensors alone still do
