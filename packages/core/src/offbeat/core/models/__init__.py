"""Models offbeat can build offline: a tiny random Qwen2 causal LM and its character
tokenizer, for tests and the embedded CPU job."""

from offbeat.core.models.hf import check_tied, load_causal_lm
from offbeat.core.models.tiny import (
    TINY_MODEL_PRESETS,
    TinyModelSpec,
    build_tiny_model,
    cache_root,
    default_cache_dir,
    tiny_model_num_parameters,
)
from offbeat.core.models.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    char_vocab,
)

__all__ = [  # the builder, its presets, and the tokenizer it writes
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_MODEL_PRESETS",
    "TinyModelSpec",
    "build_char_tokenizer",
    "build_tiny_model",
    "cache_root",
    "char_vocab",
    "check_tied",
    "default_cache_dir",
    "load_causal_lm",
    "tiny_model_num_parameters",
]
