"""Tools and tool-call parsing: the Hermes parser, the AST calculator, user tools from
"pkg.mod:fn" with a JSON schema, and the runner (concurrent calls, a timeout each, errors
as observations, never blocking the event loop)."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from offbeat.core.agent import (
    TOOL_PARSERS,
    HermesParser,
    Tool,
    ToolCall,
    ToolRunner,
    calculate,
    load_tool,
    tool,
)


# ---- parsing --------------------------------------------------------------------------
def test_hermes_reads_every_call_in_order():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
        '</tool_call> and <tool_call>\n{"name": "lookup", "arguments": "{\\"q\\": \\"x\\"}"}\n'
        "</tool_call>"
    )
    out = HermesParser().parse(text)
    assert out.calls == [
        ToolCall("calculator", {"expression": "1+2"}),
        ToolCall("lookup", {"q": "x"}),  # arguments given as a JSON string
    ]
    assert out.errors == [] and out.attempted


def test_hermes_reports_malformed_calls_without_raising():
    out = HermesParser().parse(
        '<tool_call>{"name": "calculator", "arguments": {</tool_call>'
        '<tool_call>["not", "an", "object"]</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"'
    )
    assert out.calls == []
    assert len(out.errors) == 4
    assert "not valid JSON" in out.errors[0]
    assert "JSON object" in out.errors[1]
    assert "'name'" in out.errors[2]
    assert "without a closing" in out.errors[3]


def test_no_tool_call_is_not_an_attempt():
    assert not HermesParser().parse("The answer is 42.").attempted


def test_parser_tags_are_configurable_and_registered():
    parser = TOOL_PARSERS.get("hermes")(start="[CALL]", end="[/CALL]")
    out = parser.parse('x [CALL]{"name": "f", "arguments": {}}[/CALL]')
    assert out.calls == [ToolCall("f", {})]
    assert not parser.parse('<tool_call>{"name": "f"}</tool_call>').attempted


# ---- the calculator ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("expr", "want"),
    [("123*456", "56088"), ("(2+3)**2 - 4/2", "23"), ("-7 // 2", "-4"), ("10 % 4", "2"),
     ("1/4", "0.25"), ("98765 * 4321", str(98765 * 4321))],
)  # fmt: skip
def test_calculator_computes_arithmetic(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize(
    "expr",
    ["__import__('os').system('true')", "().__class__", "x + 1", "[1, 2]", "2 ** 1000",
     "1/0", "'a' * 3", "lambda: 1"],
)  # fmt: skip
def test_calculator_refuses_anything_but_arithmetic(expr):
    with pytest.raises(ValueError):
        calculate(expr)


# ---- user tools -------------------------------------------------------------------------
def test_user_tool_from_module_path_with_its_schema(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        "def weather(city, unit='C'):\n"
        "    '''The weather in a city.'''\n"
        "    return {'city': city, 'deg': 21, 'unit': unit}\n"
        "weather.tool_schema = {'type': 'object', 'properties': {'city': {'type': 'string'},"
        " 'unit': {'type': 'string'}}, 'required': ['city'], 'additionalProperties': False}\n"
        "def add(a: int, b: int = 0):\n    return a + b\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_tools", None)
    weather = load_tool("my_tools:weather")
    assert weather.name == "weather" and weather.description == "The weather in a city."
    assert weather.schema()["function"]["parameters"]["required"] == ["city"]
    add = load_tool("my_tools:add")  # schema from the signature
    assert add.parameters["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert add.parameters["required"] == ["a"]
    runner = ToolRunner([weather, add])
    results = asyncio.run(
        runner.run(
            [ToolCall("weather", {"city": "Oslo"}), ToolCall("weather", {"town": "Oslo"}),
             ToolCall("add", {"a": "1"}), ToolCall("add", {"a": 2, "b": 3})]
        )
    )  # fmt: skip
    assert results[0].content == '{"city": "Oslo", "deg": 21, "unit": "C"}' and not results[0].error
    assert results[1].error and "missing required argument" in results[1].content
    assert results[2].error and "must be of type integer" in results[2].content
    assert results[3].content == "5"


def test_load_tool_names_what_is_wrong():
    with pytest.raises(KeyError, match="calculator"):
        load_tool("no_such_tool")
    with pytest.raises(ValueError, match="cannot import"):
        load_tool("no_such_module_xyz:fn")


# ---- the runner ---------------------------------------------------------------------------
def test_errors_and_timeouts_become_observations():
    async def hang() -> str:
        await asyncio.sleep(3600)
        return "never"

    def boom() -> str:
        raise RuntimeError("disk on fire")

    runner = ToolRunner(
        [Tool("hang", hang), Tool("boom", boom), load_tool("calculator")], timeout_s=0.05
    )
    results = asyncio.run(
        runner.run(
            [ToolCall("hang", {}), ToolCall("boom", {}), ToolCall("nope", {}),
             ToolCall("calculator", {"expression": "1/0"}),
             ToolCall("calculator", {"expression": "6*7"})]
        )
    )  # fmt: skip
    assert [r.error for r in results] == [True, True, True, True, False]
    assert results[0].timed_out and "timed out" in results[0].content
    assert results[1].content == "error: RuntimeError: disk on fire"
    assert "unknown tool 'nope'" in results[2].content
    assert "division by zero" in results[3].content
    assert results[4].content == "42"


def test_calls_of_one_turn_run_concurrently():
    # Each tool waits for the other: run one after the other, both would time out.
    a, b = asyncio.Event(), asyncio.Event()

    async def ping() -> str:
        a.set()
        await b.wait()
        return "ping"

    async def pong() -> str:
        b.set()
        await a.wait()
        return "pong"

    runner = ToolRunner([Tool("ping", ping), Tool("pong", pong)], timeout_s=5)
    results = asyncio.run(runner.run([ToolCall("ping", {}), ToolCall("pong", {})]))
    assert [r.content for r in results] == ["ping", "pong"]


def test_a_blocking_tool_never_blocks_the_event_loop():
    # The sync tool blocks until a coroutine on the event loop releases it: were it run
    # on the loop, that coroutine could never run and the tool would time out.
    released = threading.Event()

    @tool("slow")
    def slow() -> str:
        return "done" if released.wait(timeout=5) else "stuck"

    async def main() -> list:
        runner = ToolRunner([slow], timeout_s=10)
        job = asyncio.create_task(runner.run([ToolCall("slow", {})]))
        ticks = 0
        while not job.done():
            ticks += 1
            if ticks == 3:
                released.set()
            await asyncio.sleep(0.001)
        return [ticks, *(await job)]

    ticks, result = asyncio.run(main())
    assert ticks >= 3 and result.content == "done"


def test_long_outputs_are_cut():
    runner = ToolRunner([Tool("big", lambda: "x" * 5000)], max_chars=100)
    (r,) = asyncio.run(runner.run([ToolCall("big", {})]))
    assert len(r.content) == 100 and not r.error
