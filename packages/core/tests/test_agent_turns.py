"""Token-exact multi-turn trajectories, for a Qwen2-style and a Llama-3-style chat
template built locally: the trajectory's ids are the template's rendering of the whole
conversation token for token, the mask is 1 exactly on the sampled tokens, and the
rollout log-probs are the sampled ones there (0 elsewhere); for 1, 2 and 5 turns and for
turns cut by length (mid-conversation and at the end).
"""

from __future__ import annotations

import asyncio

import pytest
from agent_fakes import ScriptedClient, call_text, expected_conversation
from agent_templates import llama3_eos_ids, llama3_tokenizer, qwen2_tokenizer

from offbeat.core.agent import (
    TemplateError,
    ToolAgentLoop,
    ToolLoopConfig,
    TurnTemplate,
    load_tool,
)
from offbeat.core.rewards import RewardRegistry

ROW = {
    "prompt": [{"role": "user", "content": "What is 12*34? Use the calculator."}],
    "data_source": "math",
    "ground_truth": "408",
}
FINAL = "The answer is 408."


@pytest.fixture(params=["qwen2", "llama3"])
def chat(request):
    """(tokenizer, eos ids to pass, the template's layout)."""
    if request.param == "qwen2":
        tok = qwen2_tokenizer()
        eos = []
    else:
        tok = llama3_tokenizer()
        eos = llama3_eos_ids(tok)
    return tok, eos, TurnTemplate(tok, eos)


def test_turn_separator_is_derived_from_the_template():
    q = qwen2_tokenizer()
    tq = TurnTemplate(q)
    assert q.convert_ids_to_tokens([tq.end_of_turn_id]) == ["<|im_end|>"]
    assert tq.separator == q.encode("\n", add_special_tokens=False)
    lt = llama3_tokenizer()
    tl = TurnTemplate(lt, llama3_eos_ids(lt))  # eos_token_id of the model: a list
    assert lt.convert_ids_to_tokens([tl.end_of_turn_id]) == ["<|eot_id|>"]
    assert tl.separator == []


def test_a_template_that_ends_turns_with_no_known_eos_is_refused():
    # The Llama-3 tokenizer's own eos (<|end_of_text|>) never closes a turn.
    with pytest.raises(TemplateError, match="eos ids"):
        TurnTemplate(llama3_tokenizer())


def _run(tok, eos, client, *, max_tokens=512, n=1, **cfg):
    loop = ToolAgentLoop(
        client, tok, RewardRegistry({}), {"temperature": 1.0, "max_tokens": max_tokens},
        tools=[load_tool("calculator")], config=ToolLoopConfig(eos_ids=eos, **cfg),
        max_prompt_length=4096,
    )  # fmt: skip
    return asyncio.run(loop.sample("g", ROW, n))


def _check_exact(tok, layout, client, traj, session="g-0"):
    calls = client.session_calls(session)
    conv = expected_conversation(tok, calls, layout.eos_ids)
    schemas = [load_tool("calculator").schema()]
    expected = layout.render([*ROW["prompt"], *conv], tools=schemas)
    again = tok.apply_chat_template([*ROW["prompt"], *conv], tools=schemas, tokenize=True)
    assert list(again["input_ids"]) == expected  # the same rendering, HF's own way
    ids = traj.prompt_ids + traj.response_ids
    # The trajectory ends with the last sampled token; the template goes on with what
    # closes that turn (the separator, or end-of-turn + separator after a cut).
    assert ids + layout.closing_ids(calls[-1]["ids"]) == expected
    # Mask 1 exactly on the sampled tokens, their log-probs in place, 0 elsewhere.
    sampled = [t for c in calls for t in c["ids"]]
    logprobs = [x for c in calls for x in c["logprobs"]]
    mask = traj.response_mask
    assert [t for t, m in zip(traj.response_ids, mask, strict=True) if m] == sampled
    assert [x for x, m in zip(traj.rollout_log_probs, mask, strict=True) if m] == logprobs
    assert all(x == 0.0 for x, m in zip(traj.rollout_log_probs, mask, strict=True) if not m)
    # Each sampled turn is one contiguous run of 1s, at the position the prompt grew to.
    for c in calls:
        start = len(c["prompt"]) - len(traj.prompt_ids)
        assert traj.response_ids[start : start + len(c["ids"])] == c["ids"]
        assert mask[start : start + len(c["ids"])] == [1] * len(c["ids"])
        assert start == 0 or mask[start - 1] == 0
    return calls


@pytest.mark.parametrize("turns", [1, 2, 5])
def test_trajectory_equals_the_template_rendering(chat, turns):
    tok, eos, layout = chat
    script = [call_text(f"{k + 2}*{k + 3}") for k in range(turns - 1)] + [FINAL]
    client = ScriptedClient(tok, layout.end_of_turn_id, script)
    (traj,) = _run(tok, eos, client, max_turns=5)
    calls = _check_exact(tok, layout, client, traj)
    assert len(calls) == turns
    assert traj.info["turns"] == turns and traj.info["stop/no_tool_call"] == 1
    assert traj.info["tool_calls"] == turns - 1
    assert traj.reward == 1.0  # the final answer, not a tool's output, is scored
    if turns > 1:
        assert 0 in traj.response_mask  # observation tokens are in, masked out


def test_final_turn_cut_by_length(chat):
    tok, eos, layout = chat
    final = FINAL + " I will now explain the multiplication in detail, digit by digit."
    first = call_text("12*34")
    cap = len(tok.encode(first, add_special_tokens=False)) + 1  # the call and its eos fit
    assert len(tok.encode(final, add_special_tokens=False)) > cap
    client = ScriptedClient(tok, layout.end_of_turn_id, [first, final])
    (traj,) = _run(tok, eos, client, max_tokens_per_turn=cap)
    calls = _check_exact(tok, layout, client, traj)
    assert [c["stop"] for c in calls] == ["stop", "length"]
    assert traj.response_ids[-1] not in layout.eos_ids  # cut: no end-of-turn sampled


def test_mid_conversation_turn_cut_by_length_is_closed_by_the_template(chat):
    tok, eos, layout = chat
    first = call_text("12*34") + " and then I keep talking for quite a while longer"
    cap = len(tok.encode(call_text("12*34") + " and", add_special_tokens=False))
    client = ScriptedClient(tok, layout.end_of_turn_id, [first, FINAL])
    (traj,) = _run(tok, eos, client, max_tokens_per_turn=cap)
    calls = _check_exact(tok, layout, client, traj)
    assert [c["stop"] for c in calls] == ["length", "stop"]
    # The end-of-turn token after the cut turn is the template's, not the policy's.
    cut = len(calls[0]["ids"])
    assert traj.response_ids[cut] == layout.end_of_turn_id and traj.response_mask[cut] == 0


def test_response_budget_cuts_the_last_turn(chat):
    tok, eos, layout = chat
    client = ScriptedClient(tok, layout.end_of_turn_id, [call_text("12*34"), FINAL])
    (full,) = _run(tok, eos, client)
    budget = len(full.response_ids) - 2
    client = ScriptedClient(tok, layout.end_of_turn_id, [call_text("12*34"), FINAL])
    (traj,) = _run(tok, eos, client, max_tokens=budget)
    _check_exact(tok, layout, client, traj)
    assert len(traj.response_ids) == budget
    assert client.calls[-1]["stop"] == "length"


def test_sampled_tokens_are_kept_even_when_not_canonical():
    tok = qwen2_tokenizer()
    layout = TurnTemplate(tok)
    # "408" spelt one byte-token at a time: decoding and re-encoding would merge them.
    spelt = [tok.convert_tokens_to_ids(ch) for ch in "408"] + [layout.end_of_turn_id]
    assert tok.encode("408", add_special_tokens=False) != spelt[:-1]
    client = ScriptedClient(tok, layout.end_of_turn_id, ["unused"], t0=spelt)
    (traj,) = _run(tok, [], client)
    assert traj.response_ids == spelt
    assert traj.reward == 1.0
