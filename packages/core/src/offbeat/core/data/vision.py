"""Vision inputs of a prompt, from the model's processor to the engine and to the trainer.

Knows processors (`transformers.AutoProcessor`) and tensors, nothing of engines or
training. One path: `encode_vision_prompt` renders the chat with the processor's template
and runs the processor on the images, giving the prompt's token ids (each image's
placeholder widened to its tokens, as the model sees them), the model's vision inputs
(`pixel_values`, `image_grid_thw` for Qwen2-VL) and the images as PNG bytes for the
engine (`multi_modal_data`, which the engine runs through the same image processor).
The trainer's forward gets the same vision inputs back from `vision_model_kwargs`, so
its log-probs are those of the tokens the engine saw.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from offbeat.core.config.schema import ModelConfig

__all__ = [
    "MULTI_MODAL_DATA",
    "VisionPrompt",
    "encode_vision_prompt",
    "encode_vision_text",
    "has_vision",
    "load_processor",
    "load_tokenizer",
    "png_bytes",
    "vision_model_kwargs",
]

# The sampling-params key that carries a prompt's images to a rollout server:
# {"image": [PNG bytes, ...]} in placeholder order. A server pops it before it builds its
# engine's sampling params; a client passes it through untouched (also on a resume).
MULTI_MODAL_DATA = "multi_modal_data"

# The processor outputs the model's forward takes per image, concatenated over images.
_VISION_KEYS = ("pixel_values", "image_grid_thw")


@dataclass
class VisionPrompt:
    """One prompt with images: `prompt_ids` (placeholders widened), `model_inputs`
    (processor tensors for the model's forward, e.g. pixel_values [patches, D] and
    image_grid_thw [images, 3]) and `images` (PNG bytes, for the engine)."""

    prompt_ids: list[int]
    model_inputs: dict[str, torch.Tensor]
    images: list[bytes]

    def multi_modal_data(self) -> dict[str, list[bytes]]:
        return {"image": list(self.images)}


def png_bytes(image: Any) -> bytes:
    """A PIL image as PNG bytes (lossless: the engine decodes the pixels the trainer has)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def has_vision(processor: Any) -> bool:
    """Whether `processor` (an AutoProcessor result, or a tokenizer) processes images."""
    return getattr(processor, "image_processor", None) is not None


_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(model_dir: Any, trust_remote_code: bool = False) -> Any | None:
    """The model's AutoProcessor when `model_dir` (a local directory) has one that
    processes images; None for a text model (or a hub name, which is not looked up)."""
    from pathlib import Path

    d = Path(str(model_dir))
    if not any((d / f).is_file() for f in _PROCESSOR_FILES):
        return None
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(d), trust_remote_code=trust_remote_code)
    return processor if has_vision(processor) else None


def load_tokenizer(model_dir: Any, model: ModelConfig) -> tuple[Any, Any | None]:
    """(tokenizer, processor) of the prepared model in `model_dir`: a vision-language
    model's processor renders and tokenises rows with images (None for a text model), and
    its tokenizer is the run's unless `model.tokenizer_path` names one."""
    processor = load_processor(model_dir, model.trust_remote_code)
    if processor is not None and not model.tokenizer_path:
        return processor.tokenizer, processor
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model.tokenizer_path or str(model_dir), trust_remote_code=model.trust_remote_code
    )
    return tokenizer, processor


def encode_vision_prompt(
    processor: Any, messages: Sequence[Mapping[str, Any]], images: Sequence[Any]
) -> VisionPrompt:
    """The prompt of `messages` (content as text/image parts) with `images` (PIL, in
    placeholder order) through `processor`, with the assistant turn opened."""
    text = processor.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return encode_vision_text(processor, text, images)


def encode_vision_text(processor: Any, text: str, images: Sequence[Any]) -> VisionPrompt:
    """A rendered prompt `text` (one placeholder per image, as the chat template writes
    it) with `images` (PIL, in placeholder order) through `processor`: the prompt of a
    template rendered elsewhere (the tool loop's, with its tool schemas)."""
    enc = processor(text=[text], images=list(images) or None, return_tensors="pt")
    ids = [int(t) for t in enc["input_ids"][0]]
    inputs = {k: enc[k] for k in _VISION_KEYS if k in enc and enc[k] is not None}
    return VisionPrompt(ids, inputs, [png_bytes(im) for im in images])


def vision_model_kwargs(
    rows: Sequence[Mapping[str, torch.Tensor] | None],
    input_ids: torch.Tensor,
    image_token_id: int | None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """The forward's vision keywords for a batch whose row `i` has vision inputs `rows[i]`
    (None: a text-only row): each key concatenated over the rows in order, as the model
    matches images to placeholder tokens in reading order, plus `mm_token_type_ids` (1 on
    image tokens) where the model computes multimodal RoPE from it. Empty when no row has
    images. Position ids are left to the model (its multimodal RoPE needs the image grid).
    Raises ValueError for a row with image tokens and no vision inputs (the model would
    read its placeholders as text)."""
    if image_token_id is not None:
        with_images = (input_ids == image_token_id).any(dim=-1).tolist()
        for i, has in enumerate(with_images):
            if has and not (i < len(rows) and rows[i]):
                raise ValueError(
                    f"row {i} of the batch has image tokens (id {image_token_id}) but no "
                    "vision inputs (Trajectory.multi_modal)"
                )
    present = [r for r in rows if r]
    if not present:
        return {}
    device = input_ids.device
    out = {
        k: torch.cat([r[k] for r in present]).to(device) for k in _VISION_KEYS if k in present[0]
    }
    if image_token_id is not None:
        out["mm_token_type_ids"] = (input_ids == image_token_id).long()
    if "pixel_values" in out:
        out["pixel_values"] = out["pixel_values"].to(dtype)  # the vision tower's dtype
    return out
