"""Build a tiny Qwen2-VL-architecture vision-language model with random weights, offline.

Knows nothing about engines or training: it writes an ordinary Hugging Face directory
(config.json, model.safetensors, the character tokenizer of `tokenizer` plus Qwen2-VL's
four vision tokens, a chat template that renders list-style content, and the processor's
files: `Qwen2VLImageProcessor` at one fixed image size) that `transformers`' AutoProcessor
and vLLM both load. About 1.3M parameters: a 2-block vision tower of width 64 (patches of
14 px, 2x2 merge) in front of the `tiny` text preset. A build is cached under a hash of
its arguments, as `build_tiny_model`'s are.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

from offbeat.core.models.tiny import atomic_build, default_cache_dir

__all__ = [
    "TINY_VLM_PREFIX",
    "VISION_TOKENS",
    "VLM_CHAT_TEMPLATE",
    "build_tiny_vlm",
    "tiny_vlm_processor",
]

TINY_VLM_PREFIX = "offbeat-tiny-vl"  # model.path that names this build
_BUILDER_VERSION = 1
_MARKER = "offbeat_tiny_vlm.json"

# Ids 260.. after the character vocabulary's 256 bytes and 4 chat tokens.
VISION_TOKENS: tuple[str, ...] = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# ChatML (as `tokenizer.CHAT_TEMPLATE`) with list-style content: a text part is its text,
# an image part is Qwen2-VL's placeholder, which the processor widens to the image's tokens.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TEXT = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    # head_dim 32: 16 rotary frequencies split over (time, height, width)
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    "rms_norm_eps": 1e-6,
}
_VISION = {
    "depth": 2,
    "embed_dim": 64,
    "hidden_size": 128,  # the merger's output: the text model's width
    "num_heads": 4,
    "mlp_ratio": 2,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def tiny_vlm_processor(image_size: int = 112) -> Any:
    """The processor a `build_tiny_vlm(image_size=...)` build saves, made without the
    model (what `offbeat check` renders image prompts with)."""
    return _processor(image_size)


def _processor(image_size: int) -> Any:
    from tokenizers import AddedToken
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    from offbeat.core.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    fast.chat_template = VLM_CHAT_TEMPLATE
    pixels = image_size * image_size  # one size: every image becomes the same grid
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels),
        tokenizer=fast,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=VLM_CHAT_TEMPLATE,
    )


def _model(vocab: dict[str, int], seed: int, std: float) -> Any:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(
        _TEXT,
        vocab_size=len(vocab),
        initializer_range=std,
        bos_token_id=None,
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|pad|>"],
        dtype="float32",
    )
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(_VISION, initializer_range=0.02),
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2VLForConditionalGeneration(config).to(torch.float32)


def build_tiny_vlm(
    out_dir: str | Path | None = None,
    *,
    seed: int = 0,
    image_size: int = 112,
    initializer_range: float = 0.3,
) -> Path:
    """Write a random tiny Qwen2-VL model + processor into `out_dir`; return its path.

    `image_size` (a multiple of 28) is the side every image is resized to: 112 gives an
    8x8 patch grid, 16 image tokens. `out_dir=None`: `default_cache_dir()/vl-<hash>`; a
    directory that already holds this build is returned as is.
    """
    if image_size < 28 or image_size % 28:
        raise ValueError(
            f"build_tiny_vlm: image_size={image_size}: must be a multiple of 28 "
            "(14-pixel patches merged 2x2)"
        )
    key = {
        "builder_version": _BUILDER_VERSION,
        "text": _TEXT,
        "vision": _VISION,
        "seed": seed,
        "image_size": image_size,
        "initializer_range": float(initializer_range),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(out_dir) if out_dir is not None else default_cache_dir() / f"vl-{digest}"
    marker = out / _MARKER
    with contextlib.suppress(OSError, ValueError):
        if json.loads(marker.read_text()).get("hash") == digest:
            return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not marker.is_file():
        raise ValueError(
            f"build_tiny_vlm: out_dir={str(out)!r} exists and is not an offbeat tiny VLM "
            "build; pass an empty or new directory"
        )
    with atomic_build(out, _MARKER) as tmp:
        processor = _processor(image_size)
        processor.save_pretrained(tmp)
        model = _model(processor.tokenizer.get_vocab(), seed, float(initializer_range))
        model.save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / _MARKER).write_text(
            json.dumps({"hash": digest, "num_parameters": n_params, **key}, indent=2) + "\n"
        )
    return out
