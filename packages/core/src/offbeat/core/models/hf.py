"""Loading HF causal LMs safely from several threads of one process.

transformers' `from_pretrained` switches weight tying off for the load by replacing
`PreTrainedModel.tie_weights` on the class and putting back what it found on exit. Two
loads in two threads interleave that save/restore: the second saves the first's no-op
and restores it last, and from then on no model this process loads ties its embeddings
(a tied checkpoint comes up with a freshly initialised `lm_head`). offbeat loads models
in threads (side-by-side teacher builds, loads moved off the event loop), so every load
goes through `load_causal_lm`, one at a time, and is checked for the tying it promises;
a model built from a config (`from_config`, whose `post_init` ties) takes the same lock
(`building_models`), since a load in another thread has tying off while it runs.
"""

from __future__ import annotations

import threading
from typing import Any

_LOAD_LOCK = threading.RLock()


def building_models() -> threading.RLock:
    """The lock every HF model construction in offbeat holds (`with building_models():`)."""
    return _LOAD_LOCK


def model_class(config: Any) -> Any:
    """The transformers auto class for `config`: image-text-to-text for a vision-language
    model (a config with a `vision_config`, e.g. Qwen2-VL), else causal LM. Both output
    logits over the vocabulary for every position of `input_ids`."""
    import transformers

    if getattr(config, "vision_config", None) is not None:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_causal_lm(path: Any, **kwargs: Any):
    """`AutoModelForCausalLM.from_pretrained(path, **kwargs)` (a VLM: its image-text-to-text
    class), never two at once in this process; raises if the config ties the word
    embeddings and the loaded model does not."""
    from transformers import AutoConfig

    config = kwargs.get("config")
    if config is None:
        config = AutoConfig.from_pretrained(
            path, trust_remote_code=kwargs.get("trust_remote_code", False)
        )
    with _LOAD_LOCK:
        model = model_class(config).from_pretrained(path, **kwargs)
    check_tied(model, path)
    return model


def check_tied(model: Any, path: Any = None) -> None:
    """Raise when `model.config` ties the input and output embeddings and `model` holds
    them as two tensors (transformers' tying was switched off in this process)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None or getattr(out, "weight", None) is None:
        return
    if out.weight is not inp.weight:
        raise RuntimeError(
            f"{path or type(model).__name__}: the config ties the word embeddings but the "
            "loaded model holds the output head apart from the input embeddings. "
            "transformers' weight tying was switched off in this process (two "
            "from_pretrained calls ran at once in two threads); load models through "
            "offbeat.core.models.load_causal_lm, which runs them one at a time"
        )
