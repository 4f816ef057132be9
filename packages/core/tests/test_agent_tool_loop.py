"""ToolAgentLoop's behaviour: where a session stops, errors fed back as observations,
weight versions across turns, sticky sessions through the real client and balancer, a
weight sync that cuts a turn, per-row loop selection, and the train batch it makes."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
import torch
from agent_fakes import ScriptedClient, call_text
from agent_templates import qwen2_tokenizer
from trainer_fakes import make_settings

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.core.agent import AgentConfig, ToolAgentLoop, ToolLoopConfig, build_agent, load_tool
from offbeat.core.agent.metrics import agent_metrics
from offbeat.core.buffer import PromptGroup
from offbeat.core.rewards import RewardRegistry
from offbeat.core.rollout import PartialRolloutClient, TokenOutput
from offbeat.core.trainer import GroupFailed
from offbeat.core.trainer.trainer import build_train_batch

ROW = {
    "prompt": [{"role": "user", "content": "What is 12*34?"}],
    "data_source": "math",
    "ground_truth": "408",
}
FINAL = "The answer is 408."


@pytest.fixture(scope="module")
def tok():
    return qwen2_tokenizer()


def loop(client, tok, *, max_tokens=512, **cfg) -> ToolAgentLoop:
    return ToolAgentLoop(
        client, tok, RewardRegistry({}), {"max_tokens": max_tokens},
        tools=[load_tool("calculator")], config=ToolLoopConfig(**cfg),
    )  # fmt: skip


def end_id(tok) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>")


async def test_stops_at_max_turns(tok):
    client = ScriptedClient(tok, end_id(tok), [call_text("1+1")] * 10)
    (t,) = await loop(client, tok, max_turns=3).sample("g", ROW, 1)
    assert len(client.calls) == 3
    assert t.info["stop/max_turns"] == 1 and t.info["turns"] == 3
    assert t.info["tool_calls"] == 3  # the last turn's call is counted, never run
    assert t.reward == 0.0


async def test_parse_failures_and_tool_errors_go_back_to_the_model(tok):
    bad = '<tool_call>{"name": "calculator", "arguments": {</tool_call>'
    unknown = call_text("1", name="wolfram")
    client = ScriptedClient(tok, end_id(tok), [bad, unknown, FINAL])
    (t,) = await loop(client, tok).sample("g", ROW, 1)
    assert len(client.calls) == 3 and t.reward == 1.0
    second, third = tok.decode(client.calls[1]["prompt"]), tok.decode(client.calls[2]["prompt"])
    assert "error: tool call is not valid JSON" in second
    assert "error: unknown tool 'wolfram'" in third
    assert t.info["parse_errors"] == 1 and t.info["tool_errors"] == 2
    m = agent_metrics([t])
    assert m["agent/parse_errors"] == 1 and m["agent/tool_errors"] == 2
    assert m["agent/stop/no_tool_call_frac"] == 1.0


async def test_weight_versions_span_every_turn(tok):
    script = [call_text("1+1"), call_text("2+2"), FINAL]
    client = ScriptedClient(tok, end_id(tok), script, versions=[3, 4, 6])
    (t,) = await loop(client, tok).sample("g", ROW, 1)
    assert (t.min_weight_version, t.max_weight_version) == (3, 6)


class TextServer:
    """A server that answers turn k of any session with `script[k]` and can abort a
    request once after `abort_after` tokens (a weight sync: the version then advances)."""

    def __init__(self, sid: str, tok, script: list[str], abort_after: int | None = None):
        self.sid, self.tok, self.script = sid, tok, script
        self.abort_after = abort_after
        self.version = 0
        self.first_prompt: dict[str, int] = {}
        self.calls: list[str] = []

    @property
    def weight_version(self) -> int:
        return self.version

    async def generate(self, request_id, prompt_ids, params):
        await asyncio.sleep(0)
        self.calls.append(request_id)
        turn = int(request_id.rsplit("-t", 1)[1])
        reply = [*self.tok.encode(self.script[turn], add_special_tokens=False), end_id(self.tok)]
        start = self.first_prompt.setdefault(request_id, len(prompt_ids))
        done = len(prompt_ids) - start  # tokens of this turn already produced
        ids = reply[done:][: params["max_tokens"]]
        v, k = self.version, self.abort_after
        if k is not None and done == 0 and len(ids) > k:
            self.abort_after = None  # once
            self.version += 1
            return TokenOutput(ids[:k], [-0.5] * k, "aborted", v)
        return TokenOutput(ids, [-0.5] * len(ids), "stop", v)


async def test_a_weight_sync_that_cuts_a_turn_resumes_it(tok):
    script = [call_text("12*34"), FINAL]
    server = TextServer("s0", tok, script, abort_after=3)
    client = PartialRolloutClient(AsyncLoadBalancer({"s0": server}))
    (t,) = await loop(client, tok).sample("g", ROW, 1)
    # The cut turn resumed under the same request id: three calls for two turns.
    assert server.calls == ["g-0-t0", "g-0-t0", "g-0-t1"]
    ref = ScriptedClient(tok, end_id(tok), script)
    (want,) = await loop(ref, tok).sample("g", ROW, 1)
    assert t.response_ids == want.response_ids and t.response_mask == want.response_mask
    assert (t.min_weight_version, t.max_weight_version) == (0, 1)
    assert t.reward == 1.0


@pytest.mark.parametrize("sticky", [True, False])
async def test_every_turn_of_a_session_reaches_one_replica_when_sticky(tok, sticky):
    script = [call_text("1+1"), call_text("2+2"), call_text("3+3"), FINAL]
    servers = {f"s{i}": TextServer(f"s{i}", tok, script) for i in range(2)}
    client = PartialRolloutClient(AsyncLoadBalancer(servers, seed=0))
    agent = loop(client, tok, sticky_sessions=sticky)
    for uid in ("a", "b", "c"):  # one session at a time: the balancer alternates
        await agent.sample(uid, ROW, 1)
    where: dict[str, set[str]] = defaultdict(set)
    for sid, server in servers.items():
        for request_id in server.calls:
            where[request_id.rsplit("-t", 1)[0]].add(sid)
    assert sorted(where) == ["a-0", "b-0", "c-0"]
    if sticky:
        assert all(len(s) == 1 for s in where.values())
    else:
        assert all(len(s) == 2 for s in where.values())


async def test_rows_pick_their_agent_loop(tok):
    client = ScriptedClient(tok, end_id(tok), [call_text("12*34"), FINAL])
    agent = build_agent(
        AgentConfig(default="single_turn", tools=["calculator"]), client, tok,
        RewardRegistry({}), {"max_tokens": 256},
    )  # fmt: skip
    (t,) = await agent.sample("a", {**ROW, "agent_name": "tool"}, 1)
    assert t.info["turns"] == 2 and t.reward == 1.0
    assert set(agent.loops) == {"single_turn", "tool"}
    with pytest.raises(GroupFailed, match="agent loop"):
        await agent.sample("b", {**ROW, "agent_name": "nope"}, 1)


async def test_the_train_batch_attends_to_tool_tokens_but_trains_only_policy_tokens(tok):
    client = ScriptedClient(tok, end_id(tok), [call_text("12*34"), FINAL])
    trajs = await loop(client, tok).sample("g", ROW, 2)
    trajs[1].reward = 0.0  # a non-zero advantage for both
    group = PromptGroup(uid="g", seq=0, prompt=ROW, submission_step=0, trajectories=trajs)
    batch, data = build_train_batch([group], make_settings(n=2).algorithm)
    mask = torch.tensor(trajs[0].response_mask)
    m = len(mask)
    assert data["response_mask"][0, :m].tolist() == mask.tolist()
    assert data["attention_mask"][0, -batch.response_width :][:m].tolist() == [1] * m
    adv = data["advantages"][0, :m]
    assert (adv[mask == 0] == 0).all() and (adv[mask == 1] != 0).all()
    again = batch.unpad()
    assert again[0].response_ids == trajs[0].response_ids
    assert again[0].response_mask == trajs[0].response_mask
