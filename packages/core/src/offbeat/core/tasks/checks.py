"""Config rules for prompt lengths, run by `offbeat.core.config.validate` before anything
starts: the dataset files' prompts fit `data.max_prompt_length`, and a prompt plus its
response fits the engine's context (`rollout.engine_kwargs.max_model_len`).

Registered with `@check` on import (`offbeat.core.trainer.job` imports this module). The
prompt rule renders prompts exactly as the agent loop does (`encode_prompt` on the row's
messages) for the first `SAMPLE_ROWS` rows of each file, so a long prompt further in is
found only at run time (its group fails). It runs only when the tokenizer loads cheaply
and offline: `model.tokenizer_path` or `model.path` a local directory with tokenizer
files, or `offbeat-tiny:<size>` (whose character tokenizer is written alone, without the
model). Otherwise it says nothing; a missing or unreadable file is another rule's report.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from offbeat.core.config.validation import Problems, check

__all__ = ["SAMPLE_ROWS", "prompt_lengths"]

log = logging.getLogger(__name__)

SAMPLE_ROWS = 1000  # rows read per file by the prompt-length rule
_TINY_PREFIX = "offbeat-tiny:"
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _load_tokenizer(cfg: Any) -> Any | None:
    """The job's tokenizer when it loads offline without building a model; else None."""
    from transformers import AutoTokenizer

    m = cfg.model
    source = m.tokenizer_path or m.path
    if not isinstance(source, str) or not source:
        return None
    if source.startswith(_TINY_PREFIX):
        from offbeat.core.models.tokenizer import save_char_tokenizer

        with tempfile.TemporaryDirectory(prefix="offbeat-tok-") as d:
            save_char_tokenizer(d)
            return AutoTokenizer.from_pretrained(d)
    d = Path(source)
    if not (d.is_dir() and any((d / f).is_file() for f in _TOKENIZER_FILES)):
        return None  # a hub name or a model without tokenizer files: not loaded here
    return AutoTokenizer.from_pretrained(str(d), trust_remote_code=m.trust_remote_code)


def prompt_lengths(path: str | Path, tokenizer: Any, prompt_key: str = "prompt") -> list[int]:
    """Token counts of the first `SAMPLE_ROWS` prompts of a parquet file, rendered as the
    agent loop renders them."""
    import pyarrow.parquet as pq

    from offbeat.core.tasks.rows import row_messages
    from offbeat.core.trainer.agent_loop import encode_prompt

    rows: list[dict[str, Any]] = []
    for batch in pq.ParquetFile(path).iter_batches(batch_size=SAMPLE_ROWS, columns=[prompt_key]):
        rows = batch.to_pylist()[:SAMPLE_ROWS]
        break
    return [len(encode_prompt(tokenizer, row_messages(r, prompt_key))) for r in rows]


@check
def _prompts_fit_max_prompt_length(cfg: Any, p: Problems) -> None:
    limit = cfg.data.max_prompt_length
    files = [
        (key, f)
        for key in ("train_files", "val_files")
        for f in (getattr(cfg.data, key) or [])
        if isinstance(f, str) and Path(f).is_file()
    ]
    if not files or not _is_int(limit) or limit < 1:
        return  # no files to read, or the bad limit is reported by its own rule
    try:
        tokenizer = _load_tokenizer(cfg)
    except Exception as e:  # the job reports an unloadable tokenizer; check skips
        log.debug("prompt-length rule skipped: tokenizer did not load (%s)", e)
        return
    if tokenizer is None:
        return
    for key, f in files:
        try:
            lengths = prompt_lengths(f, tokenizer, cfg.data.prompt_key)
        except Exception as e:  # no prompt column or unreadable: reported by the reward rule
            log.debug("prompt-length rule skipped %s (%s)", f, e)
            continue
        over = [n for n in lengths if n > limit]
        if over:
            longest = max(lengths)
            p.add(
                "data.max_prompt_length",
                limit,
                f"every prompt to fit (a longer one fails its group at run time): "
                f"{len(over)} of {len(lengths)} prompts in {Path(f).name} (data.{key}; at most "
                f"the first {SAMPLE_ROWS} rows are read) are longer (longest {longest} tokens); "
                f"set data.max_prompt_length>={longest}",
            )


@check
def _prompt_and_response_fit_the_engine(cfg: Any, p: Problems) -> None:
    max_len = (cfg.rollout.engine_kwargs or {}).get("max_model_len")
    prompt, response = cfg.data.max_prompt_length, cfg.rollout.max_tokens
    if not all(_is_int(v) for v in (max_len, prompt, response)):
        return  # unset, or a bad int reported by its own rule
    if prompt + response > max_len:
        p.add(
            "data.max_prompt_length+rollout.max_tokens",
            f"{prompt}+{response}={prompt + response}",
            f"<= rollout.engine_kwargs.max_model_len={max_len} (the engine's context holds "
            f"the prompt and its response); lower one of them or raise max_model_len",
        )
