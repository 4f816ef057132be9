"""Tools an agent may call: a small registry, a safe calculator, user tools from
"pkg.mod:fn", and the runner that executes one turn's calls.

Knows nothing about tokens, templates or engines: a call (name, JSON arguments) in, an
observation string out. The runner never raises on a tool's behalf: an unknown tool, bad
arguments, an exception or a timeout each become an observation starting with "error:"
that goes back to the model. Calls of one turn run concurrently, each with its own
timeout (`agent.tool_timeout_s`); a synchronous tool runs in a thread of its own
(`offbeat.core.user_code`), so a slow tool never blocks the event loop and a hung one never
holds a pool the next calls need (past its timeout its thread is abandoned: Python cannot
kill a thread). An observation longer than `max_chars` (`agent.tool_max_chars`) is cut
there and marked, so a tool that returns megabytes never reaches the context.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from offbeat.core.agent.parsers import ToolCall
from offbeat.core.registry import Registry
from offbeat.core.user_code import UserCodeTimeout, call_user_code

__all__ = [
    "CALCULATOR",
    "TOOLS",
    "Tool",
    "ToolResult",
    "ToolRunner",
    "calculate",
    "cut",
    "load_tool",
    "tool",
]

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


@dataclass
class Tool:
    """A callable with a JSON schema. `fn(**arguments)` may be sync or async and returns
    anything JSON-serialisable (a string is passed through)."""

    name: str
    fn: Callable[..., Any]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates render (`tools=`)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def check_arguments(self, args: Mapping[str, Any]) -> str | None:
        """What is wrong with `args` against the schema (required keys, unknown keys when
        `additionalProperties` is false, top-level types), or None."""
        props = self.parameters.get("properties", {}) or {}
        missing = [k for k in self.parameters.get("required", []) if k not in args]
        if missing:
            return f"missing required argument(s) {missing}"
        if self.parameters.get("additionalProperties") is False:
            unknown = sorted(set(args) - set(props))
            if unknown:
                return f"unknown argument(s) {unknown}; expected {sorted(props)}"
        for k, v in args.items():
            kind = (props.get(k) or {}).get("type")
            if isinstance(kind, str) and kind in _CHECKS and not _CHECKS[kind](v):
                return f"argument {k!r} must be of type {kind}, got {type(v).__name__}"
        return None


def _schema_from_signature(fn: Callable[..., Any]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(p.annotation) if p.annotation is not p.empty else None
        if isinstance(p.annotation, str):  # postponed annotations
            kind = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
                p.annotation
            )
        props[p.name] = {"type": kind} if kind else {}
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "object", "properties": props, "required": required}


def tool(
    name: str | None = None,
    *,
    description: str | None = None,
    parameters: dict[str, Any] | None = None,
) -> Callable[[Callable[..., Any]], Tool]:
    """Decorator: make a function a `Tool` (schema from `parameters`, else from its
    signature; description from its docstring's first line)."""

    def deco(fn: Callable[..., Any]) -> Tool:
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        return Tool(
            name=name or fn.__name__,
            fn=fn,
            description=description if description is not None else (doc[0] if doc else ""),
            parameters=parameters or _schema_from_signature(fn),
        )

    return deco


# ---- the built-in calculator ------------------------------------------------------------
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64
_MAX_DIGITS = 200
_MAX_CHARS = 200


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and len(str(abs(value))) > _MAX_DIGITS:
            raise ValueError(f"result has more than {_MAX_DIGITS} digits")
        return value
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.

    Parsed with `ast` and walked node by node; names, calls, attributes and everything
    else are refused, so nothing but arithmetic ever runs (no `eval`)."""
    if not isinstance(expression, str) or len(expression) > _MAX_CHARS:
        raise ValueError(f"expression must be a string of at most {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: {e.msg}") from None
    try:
        value = _eval(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


CALCULATOR = Tool(
    name="calculator",
    fn=calculate,
    description="Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 123*456"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
)

# Built-in tools by name; plugins register through the "offbeat.tools" entry points.
TOOLS: Registry[Tool] = Registry("tool", entry_point_group="offbeat.tools")
TOOLS.register("calculator", CALCULATOR)


def load_tool(spec: str) -> Tool:
    """A registered tool's name, or "pkg.mod:obj" / "path/file.py:obj" where `obj` is a
    `Tool` or a function (schema from its `tool_schema` attribute, a JSON-schema dict of
    its parameters, else from its signature)."""
    if ":" not in spec:
        return TOOLS.get(spec)
    mod_name, _, attr = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            from offbeat.core.rewards.registry import _import_file

            module = _import_file(mod_name)
        else:
            module = importlib.import_module(mod_name)
    except Exception as e:
        raise ValueError(
            f"tool {spec!r}: cannot import {mod_name!r}: {type(e).__name__}: {e}"
        ) from e
    obj = getattr(module, attr, None)
    if isinstance(obj, Tool):
        return obj
    if not callable(obj):
        raise ValueError(f"tool {spec!r}: {mod_name} has no Tool or function {attr!r}")
    return tool(attr, parameters=getattr(obj, "tool_schema", None))(obj)


# ---- running one turn's calls -----------------------------------------------------------
@dataclass(frozen=True)
class ToolResult:
    """One observation: the tool's output (or an "error: ..." text), whether it failed,
    timed out, or was cut to the runner's `max_chars`."""

    name: str
    content: str
    error: bool = False
    timed_out: bool = False
    truncated: bool = False


def cut(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` in at most `max_chars` characters, and whether it was cut: its head, then a
    marker saying how many characters were cut (the head alone where the cap is too small
    for the marker)."""
    if len(text) <= max_chars:
        return text, False
    marker = f"... [{len(text)} characters, cut to {max_chars}]"
    keep = max_chars - len(marker)
    return (text[:keep] + marker if keep > 0 else text[:max_chars]), True


class ToolRunner:
    """Runs tool calls concurrently, each under `timeout_s`; never raises for a tool.

    `max_chars`: observations longer than this are cut (a tool may return a lot).
    `threads`: synchronous calls running at once (each in a thread of its own)."""

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        timeout_s: float = 5.0,
        max_chars: int = 1000,
        threads: int = 4,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0")
        if max_chars < 1 or threads < 1:
            raise ValueError(f"max_chars={max_chars}, threads={threads}: each must be >= 1")
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.threads = threads

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    async def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in call order."""
        return list(await asyncio.gather(*(self._one(c) for c in calls)))

    async def _one(self, call: ToolCall) -> ToolResult:
        t = self.tools.get(call.name)
        if t is None:
            return self._error(
                call.name, f"unknown tool {call.name!r}; tools: {sorted(self.tools)}"
            )
        problem = t.check_arguments(call.arguments)
        if problem is not None:
            return self._error(call.name, problem)
        limit = None if inspect.iscoroutinefunction(t.fn) else (id(self), self.threads)
        try:
            value = await call_user_code(
                t.fn, kwargs=call.arguments, timeout_s=self.timeout_s, limit=limit
            )
        except UserCodeTimeout:
            return ToolResult(call.name, f"error: timed out after {self.timeout_s}s", True, True)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return self._error(call.name, f"{type(e).__name__}: {e}")
        try:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
        except Exception as e:  # a circular or otherwise unserialisable result
            return self._error(call.name, f"result is not JSON-serialisable: {e}")
        content, truncated = cut(text, self.max_chars)
        return ToolResult(call.name, content, truncated=truncated)

    def _error(self, name: str, message: str) -> ToolResult:
        content, truncated = cut(f"error: {message}", self.max_chars)
        return ToolResult(name, content, True, truncated=truncated)

    def close(self) -> None:
        """Nothing to release: each sync call has its own thread (kept for callers)."""
