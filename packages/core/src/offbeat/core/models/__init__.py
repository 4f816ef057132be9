"""Models offbeat can build offline: a tiny random Qwen2 causal LM and its character
tokenizer, and a tiny random Qwen2-VL with its processor, for tests and the embedded CPU
jobs."""

from offbeat.core.models.hf import check_tied, load_causal_lm, model_class
from offbeat.core.models.tiny import (
    TINY_MODEL_PRESETS,
    TinyModelSpec,
    build_tiny_model,
    cache_root,
    default_cache_dir,
    tiny_model_num_parameters,
)
from offbeat.core.models.tiny_vlm import TINY_VLM_PREFIX, VISION_TOKENS, build_tiny_vlm
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
    "TINY_VLM_PREFIX",
    "VISION_TOKENS",
    "TinyModelSpec",
    "build_char_tokenizer",
    "build_tiny_model",
    "build_tiny_vlm",
    "cache_root",
    "char_vocab",
    "check_tied",
    "default_cache_dir",
    "load_causal_lm",
    "model_class",
    "tiny_model_num_parameters",
]
