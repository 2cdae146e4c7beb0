"""Shape folders (soakd.shapes): parameter counts against the published ones, the written folder loading
offline in transformers, its tokenizer covering exactly the config's vocabulary, atomic writes, and the
engine arguments a shape folder brings (load_format = dummy) for vllm-local and vllm-server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from soakd import shapes
from soakd.config import EngineConfig, load
from soakd.engine.vllm_local import config_id, engine_kwargs
from soakd.engine.vllm_server import server_argv
from soakd.errors import ConfigError
from soakd.shapes import (
    MARKER,
    SHAPES,
    effective_load_format,
    engine_overrides,
    get_shape,
    kv_bytes_per_token,
    param_count,
    write_shape,
)
from soakd.tinymodel import is_model_dir

# -- parameter counts ---------------------------------------------------------------------------------

# Exact totals of the published safetensors (Llama 3.1: the hub's parameter counts).
EXACT = {"llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496}
# The model cards' rounded figures: (total, non-embedding), billions, as many decimals as they give.
QWEN_CARDS = {
    "qwen3-0.6b": ("0.6", "0.44"),
    "qwen3-8b": ("8.2", "6.95"),
    "qwen3-14b": ("14.8", "13.2"),
    "qwen3-32b": ("32.8", "31.2"),
}


@pytest.mark.parametrize("name", sorted(EXACT))
def test_llama_counts_match_the_published_totals_exactly(name: str) -> None:
    assert param_count(SHAPES[name].config) == EXACT[name]


@pytest.mark.parametrize("name", sorted(QWEN_CARDS))
def test_qwen3_counts_round_to_the_model_cards(name: str) -> None:
    cfg = SHAPES[name].config
    total, non_embedding = QWEN_CARDS[name]
    n = param_count(cfg)
    embeddings = cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg["tie_word_embeddings"] else 2)
    digits = len(total.split(".")[1])
    assert f"{n / 1e9:.{digits}f}" == total
    digits = len(non_embedding.split(".")[1])
    assert f"{(n - embeddings) / 1e9:.{digits}f}" == non_embedding


def test_qwen3_8b_is_8_19_billion() -> None:
    assert param_count(SHAPES["qwen3-8b"].config) == 8_190_735_360


def test_mimo_counts_its_mtp_layer() -> None:
    cfg = SHAPES["mimo-7b-rl"].config
    h = cfg["hidden_size"]
    with_mtp, without = param_count(cfg), param_count(cfg, include_mtp=False)
    layer = (without - 2 * cfg["vocab_size"] * h - h) // cfg["num_hidden_layers"]
    # One more decoder layer, three norms and the 2h -> h projection; embeddings and head are shared.
    assert with_mtp - without == layer + 3 * h + 2 * h * h
    assert 7.8e9 < with_mtp < 7.9e9
    assert SHAPES["mimo-7b-rl"].mtp


def test_count_follows_biases_norms_and_tying() -> None:
    base: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 10,
    }
    # head_dim 4: q 8x8, k 8x4, v 8x4, o 8x8 = 192; mlp 3*8*16 = 384; 2 norms of 8
    layer = 192 + 384 + 16
    assert param_count(base) == 2 * 10 * 8 + 2 * layer + 8
    assert param_count({**base, "tie_word_embeddings": True}) == 10 * 8 + 2 * layer + 8
    assert param_count({**base, "attention_bias": True}) == param_count(base) + 2 * (8 + 4 + 4 + 8)
    assert param_count({**base, "model_type": "qwen3"}) == param_count(base) + 2 * 2 * 4
    assert param_count({**base, "model_type": "qwen2"}) == param_count(base) + 2 * (8 + 4 + 4)
    assert param_count({"text_config": base}) == param_count(base)
    with pytest.raises(ValueError, match="intermediate_size"):
        param_count({k: v for k, v in base.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match="mixture of experts"):
        param_count({**base, "num_experts": 8})


def test_kv_bytes_per_token() -> None:
    # Qwen3-8B: 36 layers * 2 * 8 KV heads * 128 * 2 bytes
    assert kv_bytes_per_token(SHAPES["qwen3-8b"].config) == 36 * 2 * 8 * 128 * 2
    assert kv_bytes_per_token(SHAPES["llama-3.1-70b"].config, 1) == 80 * 2 * 8 * 128


def test_names_are_case_insensitive() -> None:
    assert get_shape("QWEN3-8B").name == "Qwen3-8B"
    assert get_shape(" llama-3.1-70b ").repo == "meta-llama/Llama-3.1-70B"
    with pytest.raises(KeyError, match=r"Qwen3-0\.6B"):
        get_shape("qwen4")


def test_table_keeps_the_published_config_fields() -> None:
    llama = SHAPES["llama-3.1-8b"].config
    assert llama["rope_scaling"]["rope_type"] == "llama3"
    assert llama["rope_scaling"]["factor"] == 8.0
    assert llama["rope_theta"] == 500000.0
    for s in SHAPES.values():
        cfg = s.config
        assert cfg["torch_dtype"] == "bfloat16"
        for key in (
            "architectures",
            "bos_token_id",
            "eos_token_id",
            "max_position_embeddings",
            "rms_norm_eps",
        ):
            assert key in cfg, (s.name, key)
    mimo = SHAPES["mimo-7b-rl"].config
    assert mimo["model_type"] == "mimo"
    assert mimo["architectures"] == ["MiMoForCausalLM"]
    assert mimo["num_nextn_predict_layers"] == 1


# -- the written folder ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shapes")
    return {n: write_shape(n, root / n) for n in ("qwen3-0.6b", "llama-3.1-8b", "mimo-7b-rl")}


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.1-8b", "mimo-7b-rl"])
def test_written_folder_loads_offline(
    name: str, written: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoConfig, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = written[name]
    shape = get_shape(name)
    assert not list(d.glob("*.safetensors"))
    cfg = AutoConfig.from_pretrained(str(d), trust_remote_code=shape.mtp)
    tok = AutoTokenizer.from_pretrained(str(d))
    assert cfg.vocab_size == shape.config["vocab_size"]
    assert cfg.num_hidden_layers == shape.config["num_hidden_layers"]
    # Every id a soak may draw, [0, vocab_size), is a token of both the model and the tokenizer.
    assert len(tok) == cfg.vocab_size
    assert max(tok.get_vocab().values()) == cfg.vocab_size - 1
    eos = shape.config["eos_token_id"]
    assert tok.eos_token_id == (eos if isinstance(eos, int) else eos[0])
    for tid, text in shape.specials.items():
        assert tok.convert_tokens_to_ids(text) == tid
    assert tok.decode(tok.encode("hello, world", add_special_tokens=False)) == "hello, world"
    assert tok.decode([cfg.vocab_size - 1])  # the synthetic tail decodes too
    assert "assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    marker = json.loads((d / MARKER).read_text())
    assert marker["shape"] == shape.name
    assert marker["params"] == param_count(shape.config)
    assert marker["load_format"] == "dummy"
    assert json.loads((d / "config.json").read_text()) == shape.config
    assert is_model_dir(d)


def test_refuses_a_non_empty_folder_and_replaces_it_with_force(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        write_shape("qwen3-0.6b", d)
    assert (d / "keep.txt").read_text() == "mine"
    write_shape("qwen3-0.6b", d, force=True)
    assert not (d / "keep.txt").exists()
    assert (d / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left behind


def test_an_empty_folder_is_filled(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    write_shape("qwen3-0.6b", d)
    assert (d / "config.json").is_file()


def test_bad_paths(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError):
        write_shape("qwen3-0.6b", f)
    with pytest.raises(FileNotFoundError):
        write_shape("qwen3-0.6b", tmp_path / "no" / "such")


def test_nothing_half_written_on_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(shape: shapes.Shape, out: Path) -> int:
        (out / "tokenizer.json").write_text("{")
        raise OSError("disk full")

    monkeypatch.setattr(shapes, "_save_tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        write_shape("qwen3-8b", tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
    # A forced replacement that fails leaves the old folder as it was.
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("mine")
    with pytest.raises(OSError, match="disk full"):
        write_shape("qwen3-8b", old, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert (old / "keep.txt").read_text() == "mine"


# -- engine arguments -----------------------------------------------------------------------------------


def _marker_only(root: Path, code: str | None = None) -> Path:
    """A shape folder without a tokenizer: enough for the engine arguments."""
    d = root / "shape"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SHAPES["qwen3-8b"].config))
    (d / MARKER).write_text(json.dumps({"shape": "Qwen3-8B"}))
    if code is not None:
        (d / "configuration_mimo.py").write_text(code)
    return d


def test_shape_folder_loads_dummy_in_both_engines(tmp_path: Path) -> None:
    d = _marker_only(tmp_path)
    cfg = EngineConfig()
    kwargs = engine_kwargs(cfg, str(d))
    assert kwargs["load_format"] == "dummy"
    assert "trust_remote_code" not in kwargs
    argv = server_argv(cfg.model_copy(update={"kind": "vllm-server"}), str(d), 8000, known_args=None)
    i = argv.index("--load-format")
    assert argv[i + 1] == "dummy"
    # An ordinary folder keeps vLLM's default, and the config id it always had.
    plain = engine_kwargs(cfg, str(tmp_path / "plain"))
    assert "load_format" not in plain
    assert "--load-format" not in server_argv(cfg, str(tmp_path / "plain"), 8000, known_args=None)
    assert config_id(plain) != config_id(kwargs)


def test_load_format_from_config_and_extra_args(tmp_path: Path) -> None:
    plain = str(tmp_path / "plain")
    cfg = EngineConfig(load_format="dummy")
    assert engine_kwargs(cfg, plain)["load_format"] == "dummy"
    assert effective_load_format("dummy", {}, plain) == "dummy"
    assert effective_load_format("auto", {}, plain) == "auto"
    assert effective_load_format("auto", {"load_format": "dummy"}, plain) == "dummy"
    d = _marker_only(tmp_path)
    assert effective_load_format("auto", {}, str(d)) == "dummy"


def test_load_format_is_validated(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[engine]\nload_format = "random"\n')
    with pytest.raises(ConfigError, match="load_format"):
        load(cfg)
    cfg.write_text('[engine]\nload_format = "dummy"\n')
    assert load(cfg).engine.load_format == "dummy"


def test_remote_code_only_for_the_code_soakd_writes(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    good = _marker_only(tmp_path / "a", shapes.MIMO_CONFIG_CODE)
    assert engine_overrides(str(good)) == {"load_format": "dummy", "trust_remote_code": True}
    (tmp_path / "b").mkdir()
    bad = _marker_only(tmp_path / "b", shapes.MIMO_CONFIG_CODE + "\nimport os\n")
    assert engine_overrides(str(bad)) == {"load_format": "dummy"}
    assert engine_overrides(str(tmp_path / "nothing")) == {}
