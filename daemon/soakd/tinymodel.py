"""Build the tiny random-weight Qwen3 model and byte-level BPE tokenizer that demos and tests run on.

Nothing is downloaded: the tokenizer is trained on a few lines of text and the weights are random, so a
real vLLM engine starts on a machine with no hub access. Same architecture on CPU and GPU builds
(head_dim 64: the CPU attention backend refuses smaller heads).
"""

from __future__ import annotations

from pathlib import Path

from soakd.shapes import MARKER

_CORPUS_LINE = "the quick brown fox jumps over the lazy dog "


def build_tiny_model(out_dir: Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """Write config, weights and tokenizer into out_dir (created; files replaced) and return it."""
    # Heavy imports stay local: the CLI must answer `--help` without loading torch.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = [_CORPUS_LINE * 3 + str(i) for i in range(200)]
    corpus.append("0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    fast.save_pretrained(str(out_dir))
    cfg = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        eos_token_id=0,
        bos_token_id=0,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )  # type: ignore[call-arg]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[no-untyped-call,arg-type]
    model.save_pretrained(str(out_dir))
    return out_dir


def is_model_dir(path: Path) -> bool:
    """True when path holds a config and weights vLLM can load, or a shape folder (`soakd model shape`:
    a config and no weights, loaded with random ones)."""
    if not (path / "config.json").is_file():
        return False
    return (path / MARKER).is_file() or any(p.suffix == ".safetensors" for p in path.iterdir())
