"""The tiny random Qwen2 model builder: files, caching, tokenizer, and loading with
transformers (vLLM loading is covered by offbeat-rollout-vllm's e2e tests)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from offbeat.core.models import (
    SPECIAL_TOKENS,
    TINY_MODEL_PRESETS,
    build_char_tokenizer,
    build_tiny_model,
    char_vocab,
    tiny_model_num_parameters,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


def test_writes_an_hf_directory(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    for required in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert required in names
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == len(char_vocab()) == 256 + len(SPECIAL_TOKENS)
    assert "chat_template" in json.loads((tiny_dir / "tokenizer_config.json").read_text())
    weights = load_file(str(tiny_dir / "model.safetensors"))
    assert sum(t.numel() for t in weights.values()) == tiny_model_num_parameters("tiny")
    assert all(t.dtype == torch.float32 for t in weights.values())


def test_repeat_call_is_cached(tiny_dir):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()}
    assert build_tiny_model(tiny_dir, "tiny", seed=0) == tiny_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_dir.iterdir()} == before


def test_default_dir_is_keyed_by_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFBEAT_CACHE_DIR", str(tmp_path))
    a = build_tiny_model(size="tiny", num_hidden_layers=1)
    b = build_tiny_model(size="tiny", num_hidden_layers=1)
    c = build_tiny_model(size="tiny", num_hidden_layers=1, seed=1)
    d = build_tiny_model(size="tiny", num_hidden_layers=1, dtype=torch.bfloat16)
    assert a == b and len({a, c, d}) == 3
    assert a.parent == tmp_path / "tiny_models"
    wa, wc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    assert load_file(str(d / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16


def test_changed_arguments_rebuild_in_place(tmp_path):
    out = tmp_path / "m"
    build_tiny_model(out, "tiny", num_hidden_layers=1, seed=0)
    w0 = load_file(str(out / "model.safetensors"))["lm_head.weight"]
    build_tiny_model(out, "tiny", num_hidden_layers=1, seed=1)
    w1 = load_file(str(out / "model.safetensors"))["lm_head.weight"]
    assert not torch.equal(w0, w1)


def test_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an offbeat tiny-model build"):
        build_tiny_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"size": "huge"}, "valid sizes: .*tiny"),
        ({"dtype": "int8"}, "valid dtypes"),
        ({"num_layers": 3}, "unknown override.*num_hidden_layers"),
        ({"num_attention_heads": 3}, "not divisible"),
    ],
)
def test_bad_arguments_name_the_valid_choices(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_tiny_model(tmp_path / "m", **kwargs)


def test_presets_span_one_to_a_hundred_million_parameters():
    counts = [tiny_model_num_parameters(s) for s in TINY_MODEL_PRESETS]
    assert counts == sorted(counts)
    assert 0.5e6 < counts[0] < 2e6
    assert 80e6 < counts[-1] < 130e6


def test_tokenizer_is_one_token_per_ascii_character():
    tok = build_char_tokenizer()
    text = "Hello, world!\n\tx = [1, 2]  # ok"
    ids = tok.encode(text).ids
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    # Non-ASCII text round-trips through its UTF-8 bytes; specials are single tokens.
    assert tok.decode(tok.encode("héllo").ids) == "héllo"
    assert tok.encode("<|im_start|>").ids == [char_vocab()["<|im_start|>"]]


def test_transformers_loads_and_generates(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "The quick brown fox\njumps over 2 lazy dogs."
    assert tok(text).input_ids == build_char_tokenizer().encode(text).ids
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    prompt = torch.tensor([tok(text).input_ids])
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    new = out[0, prompt.shape[1] :].tolist()
    assert len(new) == 16
    # initializer_range=0.3 keeps greedy decoding from collapsing onto one repeated token.
    assert len(set(new)) > 4


def test_an_identical_build_renamed_in_meanwhile_is_kept_not_swapped_out(tmp_path):
    """Two builders race for one directory: the second to finish keeps the first's (same
    marker), so `out` never goes missing under a reader and its files are not deleted."""
    from offbeat.core.models.tiny import atomic_build

    out = tmp_path / "m"
    with atomic_build(out, "MARK") as tmp:
        # while we build, another builder renames the identical build into place
        out.mkdir()
        (out / "MARK").write_text("same\n")
        (out / "weights").write_text("theirs\n")
        (tmp / "MARK").write_text("same\n")
        (tmp / "weights").write_text("ours\n")
        inode = out.stat().st_ino
    assert out.stat().st_ino == inode and (out / "weights").read_text() == "theirs\n"
    assert not any(p.name.startswith(".m.") for p in tmp_path.iterdir())  # ours removed
    # a different build (another spec's marker) still replaces it
    with atomic_build(out, "MARK") as tmp:
        (tmp / "MARK").write_text("other\n")
    assert (out / "MARK").read_text() == "other\n"
