"""The `agent` config: a bad value names its key, the value and what is valid."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from offbeat.core.agent import AgentConfig
from offbeat.core.agent.loops import _agent_rules
from offbeat.core.config.validation import Problems


def problems(**kw) -> dict[str, str]:
    p = Problems()
    _agent_rules(SimpleNamespace(agent=AgentConfig(**kw)), p)
    return {x.key: f"{x.value!r}: {x.expected}" for x in p.items}


def test_defaults_and_the_tool_setup_are_valid():
    assert problems() == {}
    assert problems(default="tool", tools=["calculator"]) == {}


@pytest.mark.parametrize(
    ("kw", "key", "says"),
    [
        ({"default": "multi"}, "agent.default", "registered: single_turn, tool"),
        ({"tool_parser": "xml"}, "agent.tool_parser", "registered: hermes"),
        ({"tools": ["abacus"]}, "agent.tools", "registered tool name or 'pkg.mod:fn'"),
        ({"tools": ["no_such_mod:fn"]}, "agent.tools", "cannot import"),
        ({"default": "tool"}, "agent.tools", "at least one tool"),
        ({"max_turns": 0}, "agent.max_turns", "int > 0"),
        ({"tool_timeout_s": 0}, "agent.tool_timeout_s", "number"),
    ],
)
def test_bad_values_name_key_value_and_choices(kw, key, says):
    found = problems(**kw)
    assert key in found and says in found[key]
