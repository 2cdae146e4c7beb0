"""Real-size model folders without their weights: a deployment's shape, soaked before its weights are at hand.

A shape folder holds a published model's exact config.json and generation_config.json, a locally built
tokenizer with exactly the config's vocabulary size, and a `soakd-shape.json` marker. It holds no
weights: vLLM runs it with `load_format = "dummy"` (random weights of the config's shapes), so speed,
power and memory are those of the real model while its outputs are noise. Nothing is downloaded.

The table below copies the public Hugging Face config.json of each model (values checked against
published copies of those files); `param_count()` counts a dense decoder's parameters from any such
config, which is also how `probe.model_bytes` knows the weight bytes of a folder without weights.

Over 500 lines because the catalogue of published model configs is data: one entry per model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

MARKER = "soakd-shape.json"
"""The file that makes a folder a shape folder (no weights: vLLM loads it with load_format = dummy)."""

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


# -- the table -------------------------------------------------------------------------------------------

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
_QWEN3_GENERATION: dict[str, Any] = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    return {
        **_QWEN3_COMMON,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "tie_word_embeddings": tied,
    }


_LLAMA31_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    # The base models' config; the Instruct variants list [128001, 128008, 128009].
    "eos_token_id": 128001,
    # Not in the July 2024 files, added to the repos later; it is hidden_size / heads either way.
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
_LLAMA31_GENERATION: dict[str, Any] = {
    "bos_token_id": 128000,
    "do_sample": True,
    "eos_token_id": 128001,
    "temperature": 0.6,
    "top_p": 0.9,
    "transformers_version": "4.43.0.dev0",
}


def _llama31(hidden: int, inter: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        **_LLAMA31_COMMON,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
    }


# MiMo-7B is Qwen2-shaped (q/k/v biases, no q/k norm) plus one multi-token-prediction layer. Confirmed from
# published copies of the config: hidden 4096, intermediate 11008, 36 layers, 32 heads, 8 KV heads, vocab
# 151680, rope_theta 640000, 1 nextn layer, attention_bias true, untied embeddings. Not confirmed here:
# rms_norm_eps, max_position_embeddings and the RL model's eos id (the Base model's is 151643; the chat
# models end a turn with <|im_end|>, 151645); neither changes the shape.
_MIMO_CONFIG: dict[str, Any] = {
    "architectures": ["MiMoForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_mimo.MiMoConfig"},
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 32768,
    "max_window_layers": 36,
    "model_type": "mimo",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 640000,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    # Not confirmed either; without it transformers 5 takes the tokenizer for a Mistral one and warns.
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151680,
}

# transformers has no "mimo" config class; the published repo ships its own (remote code). This is an
# equivalent, written by soakd: a Qwen2 config that also keeps num_nextn_predict_layers.
MIMO_CONFIG_CODE = '''"""MiMo's configuration: Qwen2's plus its multi-token-prediction layers (by soakd)."""

from transformers.models.qwen2.configuration_qwen2 import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, *args, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(*args, **kwargs)
'''
_MIMO_CODE_FILE = "configuration_mimo.py"

_QWEN_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
_LLAMA_SPECIALS = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128008: "<|eom_id|>",
    128009: "<|eot_id|>",
}
_QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LLAMA_TEMPLATE = (
    "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@dataclass(frozen=True, slots=True)
class Shape:
    """One published model's shape: its config files and what its tokenizer must know."""

    name: str
    repo: str
    """The Hugging Face repository the config comes from."""
    config: dict[str, Any]
    generation_config: dict[str, Any]
    published_params: str
    """The parameter count the model card or hub page gives, as written there."""
    specials: dict[int, str]
    """Special tokens at their real ids (the tokenizer's other ids are synthetic)."""
    bos: str | None
    eos: str
    pad: str | None
    chat_template: str
    mtp: bool = False
    """True when the checkpoint has multi-token-prediction layers (num_nextn_predict_layers)."""
    code_files: dict[str, str] = field(default_factory=dict)
    """Remote-code files the config needs (loaded with trust_remote_code)."""


def _qwen3_shape(name: str, config: dict[str, Any], published: str) -> Shape:
    return Shape(
        name=name,
        repo=f"Qwen/{name}",
        config=config,
        generation_config=_QWEN3_GENERATION,
        published_params=published,
        specials=_QWEN_SPECIALS,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=_QWEN_TEMPLATE,
    )


def _llama31_shape(name: str, config: dict[str, Any], published: str) -> Shape:
    return Shape(
        name=name,
        repo=f"meta-llama/{name}",
        config=config,
        generation_config=_LLAMA31_GENERATION,
        published_params=published,
        specials=_LLAMA_SPECIALS,
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        pad=None,
        chat_template=_LLAMA_TEMPLATE,
    )


SHAPES: dict[str, Shape] = {
    s.name.lower(): s
    for s in (
        _qwen3_shape("Qwen3-0.6B", _qwen3(1024, 3072, 28, 16, tied=True), "0.6B (0.44B non-embedding)"),
        _qwen3_shape("Qwen3-8B", _qwen3(4096, 12288, 36, 32, tied=False), "8.2B (6.95B non-embedding)"),
        _qwen3_shape("Qwen3-14B", _qwen3(5120, 17408, 40, 40, tied=False), "14.8B (13.2B non-embedding)"),
        _qwen3_shape("Qwen3-32B", _qwen3(5120, 25600, 64, 64, tied=False), "32.8B (31.2B non-embedding)"),
        _llama31_shape("Llama-3.1-8B", _llama31(4096, 14336, 32, 32), "8.03B"),
        _llama31_shape("Llama-3.1-70B", _llama31(8192, 28672, 80, 64), "70.55B"),
        Shape(
            name="MiMo-7B-RL",
            repo="XiaomiMiMo/MiMo-7B-RL",
            config=_MIMO_CONFIG,
            generation_config={"bos_token_id": 151643, "eos_token_id": 151645},
            published_params="7.8B with its MTP layer (hub page, not confirmed here)",
            specials=_QWEN_SPECIALS,
            bos=None,
            eos="<|im_end|>",
            pad="<|endoftext|>",
            chat_template=_QWEN_TEMPLATE,
            mtp=True,
            code_files={_MIMO_CODE_FILE: MIMO_CONFIG_CODE},
        ),
    )
}
"""Known shapes by lower-case name."""


def get_shape(name: str) -> Shape:
    """The shape of that name (any case). Raises KeyError naming the known ones."""
    shape = SHAPES.get(name.strip().lower())
    if shape is None:
        raise KeyError(f"unknown shape {name!r} (known: {', '.join(s.name for s in SHAPES.values())})")
    return shape


# -- counting -----------------------------------------------------------------------------------------


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's settings: multimodal configs nest them under `text_config`."""
    cfg = dict(config)
    nested = cfg.get("text_config")
    if isinstance(nested, dict) and "num_hidden_layers" not in cfg:
        cfg = {**cfg, **nested}
    return cfg


def _int(cfg: Mapping[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _need(cfg: Mapping[str, Any], key: str) -> int:
    v = _int(cfg, key)
    if v is None or v < 0:
        raise ValueError(f"config.json has no usable {key}")
    return v


def param_count(config: Mapping[str, Any], *, include_mtp: bool = True) -> int:
    """Parameters of a dense decoder (Llama, Qwen2/3, MiMo and alike) from its config.json.

    Embeddings; per layer q/k/v/o (grouped KV heads, head_dim), the q/k RMS norms of Qwen3, the biases
    of Qwen2-style attention (or `attention_bias`), the gated MLP (gate/up/down, `mlp_bias`), two norms;
    the final norm; the LM head unless tied; and each multi-token-prediction layer (MiMo: a decoder layer,
    three norms and a 2h -> h projection), unless `include_mtp` is False. Raises ValueError for a config
    without the sizes, or one with experts (an MoE is not dense).
    """
    cfg = text_config(config)
    if any(_int(cfg, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError("config.json describes a mixture of experts; only dense decoders are counted")
    hidden = _need(cfg, "hidden_size")
    inter = _need(cfg, "intermediate_size")
    layers = _need(cfg, "num_hidden_layers")
    heads = _need(cfg, "num_attention_heads")
    vocab = _need(cfg, "vocab_size")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    head_dim = _int(cfg, "head_dim") or hidden // heads
    model_type = str(cfg.get("model_type", ""))
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = hidden * q + 2 * hidden * kv + q * hidden
    if model_type in ("qwen2", "mimo"):
        attn += q + 2 * kv  # Qwen2's q/k/v always carry biases, its o_proj none
    elif cfg.get("attention_bias"):
        attn += q + 2 * kv + hidden
    if model_type.startswith("qwen3"):
        attn += 2 * head_dim  # q_norm and k_norm
    mlp = 3 * hidden * inter + (2 * inter + hidden if cfg.get("mlp_bias") else 0)
    layer = attn + mlp + 2 * hidden
    total = vocab * hidden + layers * layer + hidden
    if not cfg.get("tie_word_embeddings", False):
        total += vocab * hidden
    if include_mtp:
        # token/hidden/final norms + input_proj (2h -> h) + one decoder layer; embeddings and head shared
        total += (_int(cfg, "num_nextn_predict_layers") or 0) * (layer + 3 * hidden + 2 * hidden * hidden)
    return total


def dtype_bytes(config: Mapping[str, Any]) -> int:
    """Bytes per weight element of the config's dtype (2 when it names none)."""
    cfg = text_config(config)
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return _DTYPE_BYTES.get(dtype, 2)


def kv_bytes_per_token(config: Mapping[str, Any], kv_dtype_bytes: int | None = None) -> int | None:
    """layers * 2 (K and V) * KV heads * head_dim * bytes; None when the config lacks them."""
    cfg = text_config(config)
    layers = _int(cfg, "num_hidden_layers")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads") or heads
    hidden = _int(cfg, "hidden_size")
    head_dim = _int(cfg, "head_dim") or (hidden // heads if hidden and heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return layers * 2 * kv_heads * head_dim * (kv_dtype_bytes or dtype_bytes(cfg))


# -- folders ------------------------------------------------------------------------------------------


def read_marker(path: Path) -> dict[str, Any] | None:
    """The shape marker of a folder, or None when there is none (or it is unreadable)."""
    try:
        doc = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def is_shape_dir(path: Path) -> bool:
    """True when path holds a config and the shape marker (and so needs load_format = dummy)."""
    return (path / "config.json").is_file() and (path / MARKER).is_file()


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


_TRUSTED_CODE = {_MIMO_CODE_FILE: _sha256(MIMO_CONFIG_CODE)}


def engine_overrides(model_path: str) -> dict[str, Any]:
    """Engine arguments a shape folder needs: load_format = dummy, and trust_remote_code only when its
    code files are byte for byte the ones soakd writes (a marker alone never turns remote code on)."""
    path = Path(model_path)
    if not is_shape_dir(path):
        return {}
    out: dict[str, Any] = {"load_format": "dummy"}
    code = [name for name in _TRUSTED_CODE if (path / name).is_file()]
    if code and all(_file_sha256(path / name) == _TRUSTED_CODE[name] for name in code):
        out["trust_remote_code"] = True
    return out


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def effective_load_format(engine_load_format: str, extra_args: Mapping[str, Any], model_path: str) -> str:
    """The load format the engine will use: `extra_args` wins (it is passed last), then a shape folder
    (always dummy: it has no weights), then `engine.load_format`."""
    explicit = extra_args.get("load_format")
    if isinstance(explicit, str) and explicit:
        return explicit
    return str(engine_overrides(model_path).get("load_format", engine_load_format))


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table in byte order, so that byte b is token id b."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _save_tokenizer(shape: Shape, out: Path) -> int:
    """A byte-level tokenizer with exactly the config's vocabulary size: the 256 byte tokens, the special
    tokens at their real ids, synthetic tokens everywhere else. Every id a soak may send is a real token
    for both the model and the tokenizer. Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    size = int(shape.config["vocab_size"])
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    for i in range(len(vocab), size):
        vocab[shape.specials.get(i, f"<|tok_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    named = {shape.bos, shape.eos, shape.pad}
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=shape.bos,
        eos_token=shape.eos,
        pad_token=shape.pad,
        additional_special_tokens=[t for t in shape.specials.values() if t not in named],
        model_max_length=int(shape.config["max_position_embeddings"]),
    )
    fast.chat_template = shape.chat_template
    fast.save_pretrained(str(out))
    if len(fast) != size:  # a special token that fell outside the vocabulary would grow it
        raise RuntimeError(f"tokenizer has {len(fast)} tokens, the config {size}")
    return size


def marker_doc(shape: Shape) -> dict[str, Any]:
    params = param_count(shape.config)
    from soakd import __version__

    return {
        "shape": shape.name,
        "repo": shape.repo,
        "params": params,
        "params_without_mtp": param_count(shape.config, include_mtp=False),
        "weight_bytes": params * dtype_bytes(shape.config),
        "kv_bytes_per_token": kv_bytes_per_token(shape.config),
        "load_format": "dummy",
        "mtp": shape.mtp,
        "published_params": shape.published_params,
        "soakd_version": __version__,
        "note": "config and tokenizer only, no weights: vLLM runs it with random (dummy) weights",
    }


def write_shape(name: str, out_dir: Path, *, force: bool = False) -> Path:
    """Write the shape folder `out_dir` for the named model and return it.

    Raises KeyError for an unknown name, FileExistsError when out_dir exists and is not empty (unless
    `force`: then it is replaced), NotADirectoryError when out_dir is a file, FileNotFoundError when its
    parent folder does not exist. Everything is written into a temporary folder beside out_dir first and
    renamed into place: an error leaves nothing half-written.
    """
    shape = get_shape(name)
    out_dir = Path(out_dir)
    parent = out_dir.parent
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"{out_dir} is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty (use --force to replace it)")
    if not parent.is_dir():
        raise FileNotFoundError(f"{parent} is not a folder")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=parent))
    try:
        _write_files(shape, tmp)
        # mkdtemp makes it 0700; a model folder is read by servers running as other users.
        tmp.chmod(0o755)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=parent))
            out_dir.replace(old / "x")
            tmp.replace(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.replace(out_dir)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        raise
    log.info("shape_written", shape=shape.name, dir=str(out_dir))
    return out_dir


def _dump(path: Path, doc: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def _write_files(shape: Shape, out: Path) -> None:
    _dump(out / "config.json", shape.config)
    _dump(out / "generation_config.json", shape.generation_config)
    for fname, text in shape.code_files.items():
        (out / fname).write_text(text, encoding="utf-8")
    _save_tokenizer(shape, out)
    # Last: a folder with the marker is a complete one.
    _dump(out / MARKER, marker_doc(shape))


def shape_rows() -> list[dict[str, Any]]:
    """One row per known shape, for `soakd model shapes`."""
    rows = []
    for s in SHAPES.values():
        rows.append(
            {
                "name": s.name,
                "repo": s.repo,
                "params": param_count(s.config),
                "published_params": s.published_params,
                "weight_bytes": param_count(s.config) * dtype_bytes(s.config),
                "kv_bytes_per_token": kv_bytes_per_token(s.config),
                "layers": s.config["num_hidden_layers"],
                "mtp": s.mtp,
            }
        )
    return rows
