"""`check` rejects prompts that cannot run: a dataset prompt longer than
`data.max_prompt_length` (its group would fail at run time) and a prompt-plus-response
budget larger than the engine's `max_model_len`."""

from __future__ import annotations

import pytest

from offbeat.core.cli import load_recipe_config
from offbeat.core.config import ConfigError
from offbeat.core.tasks import write_parquet
from offbeat.core.tasks.checks import SAMPLE_ROWS

# The tiny model's character tokenizer: one token per character, and the ChatML template
# adds "<|im_start|>user\n" (6), "<|im_end|>\n" (2) and "<|im_start|>assistant\n" (11).
TEMPLATE_TOKENS = 19


def problems(overrides: list[str]) -> dict[str, str]:
    try:
        load_recipe_config("separate_async", overrides)
    except ConfigError as e:
        return {p.key: str(p) for p in e.problems}
    return {}


def test_long_prompts_are_rejected_naming_the_key_and_the_longest(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "x" * 200}], "data_source": "math",
         "ground_truth": "1"},
        {"prompt": [{"role": "user", "content": "y" * 10}], "data_source": "math",
         "ground_truth": "1"},
    ]  # fmt: skip
    path = write_parquet(rows, tmp_path / "long.parquet")
    found = problems([f"data.train_files=[{path}]", "data.max_prompt_length=64"])
    assert "data.max_prompt_length" in found, found
    message = found["data.max_prompt_length"]
    assert message.startswith("data.max_prompt_length=64:"), message
    assert "1 of 2 prompts in long.parquet (data.train_files" in message, message
    assert f"longest {200 + TEMPLATE_TOKENS} tokens" in message, message
    assert f"data.max_prompt_length>={200 + TEMPLATE_TOKENS}" in message, message


def test_prompts_that_fit_pass(tmp_path):
    rows = [{"prompt": "x" * (64 - TEMPLATE_TOKENS), "data_source": "math", "ground_truth": "1"}]
    path = write_parquet(rows, tmp_path / "fits.parquet")
    overrides = [f"data.train_files=[{path}]", f"data.val_files=[{path}]"]
    assert problems([*overrides, "data.max_prompt_length=64"]) == {}
    # One token shorter and the same file is rejected: the rule reads the file.
    found = problems([*overrides, "data.max_prompt_length=63"])
    assert "longest 64 tokens" in found["data.max_prompt_length"], found


def test_only_the_first_rows_of_a_file_are_read(tmp_path):
    short = {"prompt": "x", "data_source": "math", "ground_truth": "1"}
    rows = [short] * SAMPLE_ROWS + [{**short, "prompt": "x" * 500}]
    path = write_parquet(rows, tmp_path / "big.parquet")
    assert problems([f"data.train_files=[{path}]"]) == {}


@pytest.mark.parametrize("max_model_len, rejected", [(100, True), (104, False)])
def test_prompt_and_response_must_fit_max_model_len(max_model_len, rejected):
    found = problems([
        f"rollout.engine_kwargs.max_model_len={max_model_len}",
        "data.max_prompt_length=64",
        "rollout.max_tokens=40",
    ])  # fmt: skip
    key = "data.max_prompt_length+rollout.max_tokens"
    assert (key in found) is rejected, found
    if rejected:
        assert "64+40=104" in found[key] and "rollout.engine_kwargs.max_model_len=100" in found[key]


# "<|im_start|>user\n" (6), <|vision_start|> + 16 image tokens (a 112-px image, 28-px
# merged patches) + <|vision_end|> (18), the question, "<|im_end|>\n" (2),
# "<|im_start|>assistant\n" (11): the image counts 16 tokens, not its one placeholder.
def test_image_rows_count_their_image_tokens(tmp_path):
    from offbeat.core.tasks.visual import QUESTIONS, make_visual_rows

    rows = [r for r in make_visual_rows(8, seed=0) if r["extra_info"]["question"] == "count"]
    path = write_parquet(rows[:2], tmp_path / "images.parquet")
    longest = 6 + 18 + len(QUESTIONS["count"]) + 2 + 11
    overrides = [f"data.train_files=[{path}]", f"data.val_files=[{path}]"]

    def vlm_problems(limit: int) -> dict[str, str]:
        try:
            load_recipe_config(
                "separate_async_vlm", [*overrides, f"data.max_prompt_length={limit}"]
            )
        except ConfigError as e:
            return {p.key: str(p) for p in e.problems}
        return {}

    assert vlm_problems(longest) == {}
    found = vlm_problems(longest - 1)  # fits as text with one placeholder; not with 16
    assert f"longest {longest} tokens" in found["data.max_prompt_length"], found
