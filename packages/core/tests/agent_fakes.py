"""Fakes for the tool agent loop tests: a scripted client that answers each session's
turns from a script, and helpers that rebuild the conversation a trajectory claims to be.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any

from offbeat.core.agent import HermesParser, calculate
from offbeat.core.rollout import TokenOutput


def call_text(expression: str, name: str = "calculator") -> str:
    body = json.dumps({"name": name, "arguments": {"expression": expression}})
    return f"<tool_call>{body}</tool_call>"


class ScriptedClient:
    """Turn k of every session is `script[k]`, encoded canonically and closed with
    `end_id` ("stop"), or cut at the request's max_tokens ("length"). Log-probs are
    distinct per sampled token (so their placement can be checked); turn k is produced by
    weight version `versions[k]` (default 0). Records every call."""

    def __init__(self, tok: Any, end_id: int, script: list[str], versions=None, **tokens):
        self.tok, self.end_id, self.script = tok, end_id, script
        self.versions = versions
        self.tokens = tokens  # turn -> explicit token ids (e.g. non-canonical)
        self.turns: dict[str, int] = defaultdict(int)
        self.calls: list[dict[str, Any]] = []
        self.counter = 0

    async def generate(self, request_id, prompt_ids, params, session_id=None):
        await asyncio.sleep(0)
        key = session_id if session_id is not None else request_id.rsplit("-t", 1)[0]
        turn = self.turns[key]
        self.turns[key] += 1
        given = self.tokens.get(f"t{turn}")
        ids = list(given) if given is not None else self._encode(self.script[turn])
        cap = params["max_tokens"]
        stop = "stop"
        if len(ids) > cap:
            ids, stop = ids[:cap], "length"
        logprobs = []
        for _ in ids:
            self.counter += 1
            logprobs.append(-self.counter / 1000.0)
        v = self.versions[turn] if self.versions else 0
        self.calls.append(
            {"request_id": request_id, "session_id": session_id, "prompt": list(prompt_ids),
             "ids": ids, "logprobs": logprobs, "stop": stop, "max_tokens": cap,
             "params": dict(params)}
        )  # fmt: skip
        return TokenOutput(ids, logprobs, stop, weight_version=v)

    def _encode(self, text: str) -> list[int]:
        return [*self.tok.encode(text, add_special_tokens=False), self.end_id]

    def session_calls(self, prefix: str) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["request_id"].startswith(prefix + "-t")]


def expected_conversation(tok, calls, end_ids, role="tool") -> list[dict[str, str]]:
    """The conversation a session's calls make: each turn's decoded text as the assistant
    message, then (when another turn follows) the calculator's result of each call."""
    parser = HermesParser()
    conv: list[dict[str, str]] = []
    for k, c in enumerate(calls):
        ids = c["ids"][:-1] if c["ids"] and c["ids"][-1] in end_ids else c["ids"]
        text = tok.decode(ids, skip_special_tokens=False)
        conv.append({"role": "assistant", "content": text})
        if k + 1 < len(calls):
            parsed = parser.parse(text)
            for call in parsed.calls:
                conv.append({"role": role, "content": calculate(**call.arguments)})
            for e in parsed.errors:
                conv.append({"role": role, "content": f"error: {e}"})
    return conv
