"""Tool-call parsers: an assistant turn's text in, the tool calls it makes out.

Knows nothing about tokens, tools or engines. A parser never raises on what the model
wrote: a malformed call becomes a parse error that the loop reports back to the model as
an observation (and counts). Parsers sit behind `TOOL_PARSERS`; the default, "hermes",
reads Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
(Qwen2.5, Hermes, many others), with configurable tags.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from offbeat.core.registry import Registry

__all__ = ["TOOL_PARSERS", "HermesParser", "ParseResult", "ToolCall", "ToolParser"]


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParseResult:
    """The calls of one turn, and a message per malformed one (in text order)."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def attempted(self) -> bool:
        """Whether the turn tried to call anything (well-formed or not)."""
        return bool(self.calls or self.errors)


class ToolParser(Protocol):
    def parse(self, text: str) -> ParseResult: ...


class HermesParser:
    """`<tool_call>` JSON `</tool_call>` blocks; `arguments` may be an object or a JSON
    string holding one (some models write it so). An opening tag never closed is a parse
    error (a turn cut by length mid-call)."""

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        if not start or not end:
            raise ValueError(f"HermesParser: tags must be non-empty, got {start!r}, {end!r}")
        self.start, self.end = start, end
        self._block = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.DOTALL)

    def parse(self, text: str) -> ParseResult:
        out = ParseResult()
        for m in self._block.finditer(text):
            call, error = _call_from_json(m.group(1).strip())
            if call is not None:
                out.calls.append(call)
            else:
                out.errors.append(error)
        rest = self._block.sub("", text)
        if self.start in rest:
            out.errors.append(f"{self.start} without a closing {self.end}")
        return out


def _call_from_json(body: str) -> tuple[ToolCall | None, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body[:80]!r}"
    if not isinstance(obj, dict):
        return None, f"tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None, f"tool call has no 'name' string: {body[:80]!r}"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, f"tool call {name!r}: 'arguments' is a string that is not JSON"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, f"tool call {name!r}: 'arguments' must be an object"
    return ToolCall(name, args), ""


TOOL_PARSERS: Registry[Callable[..., ToolParser]] = Registry(
    "tool parser", entry_point_group="offbeat.tool_parsers"
)
TOOL_PARSERS.register("hermes", HermesParser)
