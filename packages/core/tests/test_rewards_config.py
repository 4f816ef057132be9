"""Rewards from the config: `reward.functions` maps a data_source to a user function (checked
to import before anything starts, then used to score rows), verl-shaped rows are read as
they are, and `check` lists each data_source of the dataset files that has no function."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest

from offbeat.core.config import ConfigError, JobConfig, RewardConfig, validate
from offbeat.core.config.validation import _CHECKS
from offbeat.core.rewards import checks, reward_registry
from offbeat.core.rollout import TokenOutput
from offbeat.core.tasks import read_parquet, reward_fields, row_messages, write_parquet
from offbeat.core.trainer.agent_loop import SingleTurnAgentLoop

EXAMPLE = Path(__file__).parents[3] / "recipes" / "separate_async" / "data"


def job(reward: RewardConfig | None = None, train: list[str] = (), val: list[str] = ()):
    cfg = JobConfig()
    data = dataclasses.replace(cfg.data, train_files=list(train), val_files=list(val))
    return dataclasses.replace(cfg, reward=reward or RewardConfig(), data=data)


def problems(cfg) -> dict[str, str]:
    """key -> message of each problem `validate` finds (the default JobConfig has others,
    e.g. no model path: the tests look only at the keys they are about)."""
    try:
        validate(cfg)
    except ConfigError as e:
        return {p.key: str(p) for p in e.problems}
    return {}


def verl_row(source: str, truth: str, **extra) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": "q"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": 0, **extra},
    }


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user reward module `my_rewards_mod` importable from sys.path."""
    (tmp_path / "my_rewards_mod.py").write_text(
        textwrap.dedent(
            """
            CALLS = []

            def weighted(response, ground_truth, *, data_source, extra_info):
                CALLS.append((response, ground_truth, data_source, extra_info))
                return float(response.strip() == ground_truth) * extra_info["weight"]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_rewards_mod

    yield my_rewards_mod
    sys.modules.pop("my_rewards_mod", None)  # the next test imports its own fresh copy


def test_the_rule_is_registered_with_validate():
    assert checks._rewards in _CHECKS


# ---- reading rows --------------------------------------------------------------------------
def test_verl_and_offbeat_rows_give_the_same_reward_fields():
    row = verl_row("openai/gsm8k", "72", answer="... #### 72")
    assert reward_fields(row) == (
        "openai/gsm8k", "72", {"split": "train", "index": 0, "answer": "... #### 72"},
    )  # fmt: skip
    # a top-level ground_truth wins; no extra_info is {}; a string prompt is one user turn
    plain = {"data_source": "math", "ground_truth": "7", "prompt": "add: 3+4"}
    assert reward_fields(plain) == ("math", "7", {})
    assert row_messages(plain) == [{"role": "user", "content": "add: 3+4"}]
    assert reward_fields({"prompt": "x", "extra_info": None}) == ("", None, {})


# ---- reward.functions ----------------------------------------------------------------------
def test_bad_function_path_names_the_key_and_the_import_error():
    cfg = job(RewardConfig(functions={"my_source": "no_such_module_xyz.sub:fn"}))
    found = problems(cfg)
    assert "reward.functions.my_source" in found, found
    assert "No module named 'no_such_module_xyz'" in found["reward.functions.my_source"]


def test_missing_function_in_a_module_is_named(user_module):
    found = problems(job(RewardConfig(functions={"src": "my_rewards_mod:nope"})))
    assert "no callable 'nope'" in found["reward.functions.src"]


def test_user_function_from_the_config_scores_verl_rows(user_module, tmp_path):
    """reward.functions passes `check`, reaches the job's RewardRegistry, and the agent
    loop scores a verl-shaped row with it (ground truth from reward_model, extra_info)."""
    reward = RewardConfig(functions={"my_source": "my_rewards_mod:weighted"})
    path = write_parquet([verl_row("my_source", "42", weight=0.5)], tmp_path / "d.parquet")
    cfg = job(reward, train=[str(path)])
    assert not {k for k in problems(cfg) if k.startswith(("reward", "data.train_files"))}

    class Tokenizer:
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
            return "".join(m["content"] for m in messages)

        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode()

    class Client:
        answers = iter(["42", "41"])

        async def generate(self, request_id, prompt_ids, sampling):
            ids = list(next(self.answers).encode())
            return TokenOutput(ids, [-0.1] * len(ids), "stop", 0)

    agent = SingleTurnAgentLoop(
        Client(), Tokenizer(), reward_registry(cfg.reward), {"max_tokens": 4}
    )
    row = verl_row("my_source", "42", weight=0.5)
    trajectories = asyncio.run(agent.sample("g0", row, 2))
    assert [t.reward for t in trajectories] == [0.5, 0.0]
    assert [c[:3] for c in user_module.CALLS] == [
        ("42", "42", "my_source"),
        ("41", "42", "my_source"),
    ]
    assert user_module.CALLS[0][3] == {"split": "train", "index": 0, "weight": 0.5}


def test_functions_with_a_fixed_reward_name_are_rejected_as_unused(user_module):
    cfg = job(RewardConfig(name="exact_match", functions={"s": "my_rewards_mod:weighted"}))
    assert "unused with reward.name='exact_match'" in problems(cfg)["reward.functions"]


# ---- every data_source has a reward function -----------------------------------------------
def test_unknown_data_source_is_listed_with_the_registered_names(tmp_path):
    rows = [verl_row("openai/gsm8k", "1"), verl_row("my/unknown", "2"), verl_row("my/unknown", "3")]
    train = write_parquet(rows, tmp_path / "train.parquet")
    val = write_parquet([verl_row("lighteval/MATH", "1")], tmp_path / "val.parquet")
    found = problems(job(train=[str(train)], val=[str(val)]))
    msg = found["data.train_files"]
    assert str(train) in msg and "'my/unknown' (2 rows)" in msg
    assert "'openai/gsm8k'" not in msg.split("registered:")[0]  # known: not listed as missing
    registered = msg.split("registered:")[1]
    assert "'openai/gsm8k'" in registered and "'lighteval/MATH'" in registered
    assert "'task'" not in registered
    assert "reward.functions.<data_source>" in msg
    assert "data.val_files" not in found


def test_a_user_function_covers_its_data_source(tmp_path, user_module):
    train = write_parquet([verl_row("my/unknown", "2")], tmp_path / "train.parquet")
    reward = RewardConfig(functions={"my/unknown": "my_rewards_mod:weighted"})
    assert "data.train_files" not in problems(job(reward, train=[str(train)]))


def test_a_fixed_reward_name_scores_any_data_source(tmp_path):
    train = write_parquet([verl_row("my/unknown", "2")], tmp_path / "train.parquet")
    assert "data.train_files" not in problems(job(RewardConfig(name="math"), [str(train)]))


def test_file_without_data_source_or_prompt_column(tmp_path):
    no_source = write_parquet([{"prompt": "q", "ground_truth": "1"}], tmp_path / "a.parquet")
    no_prompt = write_parquet([{"question": "q", "data_source": "math"}], tmp_path / "b.parquet")
    not_parquet = tmp_path / "c.parquet"
    not_parquet.write_text("not parquet")
    found = problems(job(train=[str(no_source)], val=[str(no_prompt)]))
    assert "a 'data_source' column" in found["data.train_files"]
    assert "'prompt' column (data.prompt_key)" in found["data.val_files"]
    assert "a readable parquet file" in problems(job(train=[str(not_parquet)]))["data.train_files"]


def test_the_example_file_passes_and_matches_its_script(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_verl_example", EXAMPLE / "make_verl_example.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    committed = EXAMPLE / "verl_example.parquet"
    assert read_parquet(committed) == read_parquet(module.write(tmp_path / "fresh.parquet"))
    assert "data.train_files" not in problems(job(train=[str(committed)]))
