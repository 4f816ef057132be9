"""Config rules for the dataset files, run by `offbeat.core.config.validate` before anything
starts: each file holds rows, and its rows can be prompts (`bad_rows.row_problem`, the
first `CHECK_ROWS` rows of each file; the first bad ones are named with their row index);
the prompts fit `data.max_prompt_length`, and a prompt plus its response fits the
engine's context (`rollout.engine_kwargs.max_model_len`). A file that is not readable
parquet is reported by the reward rule (`offbeat.core.rewards.checks`).

Registered with `@check` on import (`offbeat.core.trainer.job` imports this module). The
prompt rule renders prompts exactly as the agent loop does (`encode_prompt` on the row's
messages) for the first `SAMPLE_ROWS` rows of each file, so a long prompt further in is
found only at run time (its group fails). A row with images is rendered through the
model's processor, as the agent loop renders it: its length counts each image's widened
placeholder (the image's tokens). It runs only when the tokenizer loads cheaply
and offline: `model.tokenizer_path` or `model.path` a local directory with tokenizer
files, or `offbeat-tiny:<size>` / `offbeat-tiny-vl` (whose tokenizer or processor is made
alone, without the model). Otherwise it says nothing; a missing or unreadable file is
another rule's report.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.config.validation import Problems, check

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = ["CHECK_ROWS", "SAMPLE_ROWS", "prompt_lengths"]

log = logging.getLogger(__name__)

SAMPLE_ROWS = 1000  # rows read per file by the prompt-length rule
CHECK_ROWS = 100_000  # rows read per file by the bad-row rule (later ones: found at run time)
_TINY_PREFIX = "offbeat-tiny:"
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _load_tokenizer(cfg: JobConfig) -> Any | None:
    """The job's tokenizer when it loads offline without building a model; else None."""
    from transformers import AutoTokenizer

    from offbeat.core.models.tiny_vlm import TINY_VLM_PREFIX, tiny_vlm_processor

    m = cfg.model
    source = m.tokenizer_path or m.path
    if not isinstance(source, str) or not source:
        return None
    if source == TINY_VLM_PREFIX:
        return tiny_vlm_processor().tokenizer
    if source.startswith(_TINY_PREFIX):
        from offbeat.core.models.tokenizer import save_char_tokenizer

        with tempfile.TemporaryDirectory(prefix="offbeat-tok-") as d:
            save_char_tokenizer(d)
            return AutoTokenizer.from_pretrained(d)
    d = Path(source)
    if not (d.is_dir() and any((d / f).is_file() for f in _TOKENIZER_FILES)):
        return None  # a hub name or a model without tokenizer files: not loaded here
    return AutoTokenizer.from_pretrained(str(d), trust_remote_code=m.trust_remote_code)


def _load_processor(cfg: JobConfig) -> Any | None:
    """The model's image processor (AutoProcessor) when it loads offline without building
    a model: `offbeat-tiny-vl`'s, or a local `model.path` with processor files; else None."""
    from offbeat.core.data.vision import load_processor
    from offbeat.core.models.tiny_vlm import TINY_VLM_PREFIX, tiny_vlm_processor

    m = cfg.model
    if not isinstance(m.path, str) or not m.path:
        return None
    if m.path == TINY_VLM_PREFIX:
        return tiny_vlm_processor()
    d = Path(m.path)
    return load_processor(d, trust_remote_code=m.trust_remote_code) if d.is_dir() else None


def prompt_lengths(
    path: str | Path, tokenizer: Any, prompt_key: str = "prompt", processor: Any | None = None
) -> list[int]:
    """Token counts of the first `SAMPLE_ROWS` prompts of a parquet file, rendered as the
    agent loop renders them: a row with images through `processor` (each image's
    placeholder widened to its tokens) when one is given."""
    import pyarrow.parquet as pq

    from offbeat.core.data.vision import encode_vision_prompt
    from offbeat.core.tasks.images import IMAGES_KEY, content_parts, decode_image, row_images
    from offbeat.core.tasks.rows import row_messages
    from offbeat.core.trainer.agent_loop import encode_prompt

    pf = pq.ParquetFile(path)
    columns = [prompt_key]
    if processor is not None and IMAGES_KEY in pf.schema_arrow.names:
        columns.append(IMAGES_KEY)
    rows: list[dict[str, Any]] = []
    for batch in pf.iter_batches(batch_size=SAMPLE_ROWS, columns=columns):
        rows = batch.to_pylist()[:SAMPLE_ROWS]
        break
    out = []
    for r in rows:
        messages = row_messages(r, prompt_key)
        images = row_images(r) if processor is not None else []
        if images:
            pil = [decode_image(im) for im in images]
            out.append(
                len(encode_vision_prompt(processor, content_parts(messages), pil).prompt_ids)
            )
        else:
            out.append(len(encode_prompt(tokenizer, messages)))
    return out


def _needs_ground_truth(cfg: JobConfig) -> bool:
    """False when one scorer scores every row and takes the ground truth as an optional
    reference (the genrm judge)."""
    from offbeat.core.registry import REWARD_FUNCTIONS

    name = cfg.reward.name
    if name == "task" or name not in REWARD_FUNCTIONS:
        return True
    return not getattr(REWARD_FUNCTIONS.get(name), "ground_truth_optional", False)


@check
def _dataset_files_exist(cfg: JobConfig, p: Problems) -> None:
    for key in ("train_files", "val_files"):
        for f in getattr(cfg.data, key):
            if not Path(f).is_file():
                p.add(f"data.{key}", f, "existing parquet files")


@check
def _dataset_rows_can_be_prompts(cfg: JobConfig, p: Problems) -> None:
    from offbeat.core.tasks.bad_rows import DatasetFileError, scan_file
    from offbeat.core.tasks.rows import parquet_columns

    prompt_key = cfg.data.prompt_key
    for key in ("train_files", "val_files"):
        for f in getattr(cfg.data, key) or []:
            if not (isinstance(f, str) and Path(f).is_file()):
                continue  # a missing file is the job rule's report
            try:
                if prompt_key not in parquet_columns(f):
                    continue  # the reward rule names the missing column
                scan = scan_file(
                    f, prompt_key, needs_ground_truth=_needs_ground_truth(cfg), limit=CHECK_ROWS
                )
            except (DatasetFileError, OSError, ValueError) as e:
                log.debug("bad-row rule skipped %s (%s)", f, e)
                continue  # not readable parquet: the reward rule's report
            name = Path(f).name
            if scan.num_rows == 0:
                p.add(f"data.{key}", f, f"a parquet file with at least one row ({name} has 0)")
            elif scan.bad:
                listed = "; ".join(f"row {i}: {why}" for i, why in scan.bad)
                more = scan.bad_count - len(scan.bad)
                p.add(
                    f"data.{key}",
                    f,
                    f"rows that can be prompts: {scan.bad_count} of the {scan.rows_read} rows "
                    f"read in {name} cannot ({listed}{f'; and {more} more' if more else ''}); "
                    "fix or remove them (a run counts a bad row it draws as a failed group, "
                    "reason bad_row)",
                )


@check
def _prompts_fit_max_prompt_length(cfg: JobConfig, p: Problems) -> None:
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
    try:
        processor = _load_processor(cfg)
    except Exception as e:  # image rows then count as text; the job reports the processor
        log.debug("prompt-length rule: processor did not load (%s)", e)
        processor = None
    for key, f in files:
        try:
            lengths = prompt_lengths(f, tokenizer, cfg.data.prompt_key, processor)
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
def _prompt_and_response_fit_the_engine(cfg: JobConfig, p: Problems) -> None:
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
