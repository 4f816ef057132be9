"""Agent loops beyond the single turn: the agent-loop registry and router, the
tool-calling multi-turn loop, its token-exact turn layout, tool-call parsers and tools."""

from offbeat.core.agent.loops import AGENT_LOOPS, AgentConfig, AgentLoopRouter, build_agent
from offbeat.core.agent.metrics import agent_metrics
from offbeat.core.agent.parsers import TOOL_PARSERS, HermesParser, ParseResult, ToolCall
from offbeat.core.agent.tool_loop import ToolAgentLoop, ToolLoopConfig
from offbeat.core.agent.tools import TOOLS, Tool, ToolResult, ToolRunner, calculate, load_tool, tool
from offbeat.core.agent.turns import TemplateError, TrajectoryBuilder, TurnTemplate, eos_token_ids

__all__ = [  # noqa: RUF022 (grouped by concept)
    # loops and their selection
    "AGENT_LOOPS",
    "AgentConfig",
    "AgentLoopRouter",
    "ToolAgentLoop",
    "ToolLoopConfig",
    "build_agent",
    "agent_metrics",
    # token-exact turns
    "TemplateError",
    "TrajectoryBuilder",
    "TurnTemplate",
    "eos_token_ids",
    # tool calls and tools
    "TOOL_PARSERS",
    "HermesParser",
    "ParseResult",
    "ToolCall",
    "TOOLS",
    "Tool",
    "ToolResult",
    "ToolRunner",
    "calculate",
    "load_tool",
    "tool",
]
