"""Warm-start traces are laid out exactly as the tool agent loop lays out a trajectory,
and the multiplication task carries the expression the calculator is called on."""

from __future__ import annotations

from agent_fakes import ScriptedClient
from agent_templates import llama3_eos_ids, llama3_tokenizer, qwen2_tokenizer

from offbeat.core.agent import ToolAgentLoop, ToolLoopConfig, TurnTemplate, load_tool
from offbeat.core.agent.traces import calculator_call, calculator_traces
from offbeat.core.rewards import RewardRegistry
from offbeat.core.tasks.synthetic import make_rows


def test_mul_rows_carry_their_expression():
    rows = make_rows("mul", 50, seed=3, min_len=2, max_len=3)
    for row in rows:
        a, b = row["extra_info"]["expression"].split("*")
        assert row["prompt"][0]["content"] == f"mul: {a}*{b}"
        assert 10 <= int(a) <= 999 and 10 <= int(b) <= 999
        assert row["ground_truth"] == str(int(a) * int(b))
    # "mix" draws from the tasks it always did
    assert {r["prompt"][0]["content"].split(":")[0] for r in make_rows("mix", 60)} == {
        "reverse", "copy", "add",
    }  # fmt: skip


async def test_traces_equal_the_loops_trajectories():
    for tok, eos in ((qwen2_tokenizer(), []), (llama3_tokenizer(), None)):
        eos = eos if eos is not None else llama3_eos_ids(tok)
        template = TurnTemplate(tok, eos)
        rows = make_rows("mul", 3, seed=1, min_len=2, max_len=3)
        traces = calculator_traces(template, rows)
        for row, (ids, mask) in zip(rows, traces, strict=True):
            expr, answer = row["extra_info"]["expression"], row["ground_truth"]
            client = ScriptedClient(tok, template.end_of_turn_id, [calculator_call(expr), answer])
            loop = ToolAgentLoop(
                client, tok, RewardRegistry({}), {"max_tokens": 512},
                tools=[load_tool("calculator")], config=ToolLoopConfig(eos_ids=eos),
            )  # fmt: skip
            (t,) = await loop.sample("g", row, 1)
            assert ids == t.prompt_ids + t.response_ids
            assert mask == [0] * len(t.prompt_ids) + t.response_mask
            assert t.reward == 1.0
