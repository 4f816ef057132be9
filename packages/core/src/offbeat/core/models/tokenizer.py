"""A byte-level, one-token-per-character tokenizer with a ChatML chat template.

Knows nothing about models. Every UTF-8 byte is one token (so printable ASCII is one token
per character and any text round-trips), plus four chat special tokens. It is a BPE with no
merges laid out exactly as Qwen2's tokenizer is (NFC, Qwen2's split regex, byte-level
pre-tokenizer and decoder), so `transformers` -- which rebuilds a Qwen2 tokenizer from the
vocabulary -- vLLM and plain `tokenizers` all encode and decode the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "char_vocab",
    "save_char_tokenizer",
]

# Ids 256.. in this order, after the 256 byte tokens (a byte's id is its value).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")

# ChatML, the format Qwen2 models use; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2's pre-tokenizer split; with no merges it only decides word boundaries.
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (ByteLevel's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def char_vocab() -> dict[str, int]:
    """Token -> id: byte b is id b (as its ByteLevel character), then the special tokens."""
    vocab = {ch: b for b, ch in sorted(_bytes_to_unicode().items())}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    return vocab


def build_char_tokenizer() -> Tokenizer:
    """A `tokenizers.Tokenizer` mapping each UTF-8 byte to one token."""
    vocab = char_vocab()
    byte_vocab = {t: i for t, i in vocab.items() if t not in SPECIAL_TOKENS}
    tok = Tokenizer(BPE(vocab=byte_vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def save_char_tokenizer(out_dir: str | Path, model_max_length: int = 2048) -> int:
    """Write tokenizer.json, vocab.json, merges.txt, tokenizer_config.json and
    special_tokens_map.json into `out_dir`; return the vocabulary size."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    vocab = char_vocab()
    (out / "vocab.json").write_text(
        json.dumps({t: i for t, i in vocab.items() if t not in SPECIAL_TOKENS}) + "\n"
    )
    (out / "merges.txt").write_text("#version: 0.2\n")
    added = {
        str(vocab[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return len(vocab)
