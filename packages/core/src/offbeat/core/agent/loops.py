"""The agent-loop registry, the job's `agent` config, and the router that picks a loop
per dataset row.

Knows nothing about engines or training: a loop is anything with
`async sample(uid, row, n, sampling) -> list[Trajectory]`. Built-ins: "single_turn"
(`SingleTurnAgentLoop`) and "tool" (`ToolAgentLoop`). A row's `agent_name` column picks
its loop; rows without one use `agent.default`. Loops are built once each, on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offbeat.core.config.validation import Problems, check
from offbeat.core.registry import Registry

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = ["AGENT_LOOPS", "AgentConfig", "AgentLoopRouter", "build_agent"]


@dataclass
class AgentConfig:
    """How trajectories are generated. `default`: the loop of rows without an
    `agent_name` (a name in `AGENT_LOOPS`). `tools`: for the "tool" loop, registered tool
    names or "pkg.mod:fn" user tools. The other keys configure the "tool" loop (see
    `ToolLoopConfig`). `val_without_tools`: validation also scores every row with the
    single-turn loop (`val/reward_no_tools`), the same model without tools."""

    default: str = "single_turn"
    tools: list[str] = field(default_factory=list)
    max_turns: int = 5
    max_tokens_per_turn: int = 0  # 0: what is left of rollout.max_tokens
    tool_parser: str = "hermes"
    parser_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_timeout_s: float = 5.0  # seconds per tool call; past it the call fails (counted)
    tool_max_chars: int = 1000  # longest observation; longer ones are cut (counted)
    max_tool_calls_per_turn: int = 4
    tool_response_role: str = "tool"
    eos_ids: list[int] = field(default_factory=list)  # beside the tokenizer's eos_token_id
    sticky_sessions: bool = True
    val_without_tools: bool = False


def _single_turn(cfg: AgentConfig, client: Any, tokenizer: Any, rewards: Any, sampling, **kw):
    from offbeat.core.trainer.agent_loop import SingleTurnAgentLoop

    return SingleTurnAgentLoop(client, tokenizer, rewards, sampling, **kw)


def _tool(cfg: AgentConfig, client: Any, tokenizer: Any, rewards: Any, sampling, **kw):
    from offbeat.core.agent.tool_loop import ToolAgentLoop, ToolLoopConfig
    from offbeat.core.agent.tools import load_tool

    loop_cfg = ToolLoopConfig(
        max_turns=cfg.max_turns,
        max_tokens_per_turn=cfg.max_tokens_per_turn,
        tool_parser=cfg.tool_parser,
        parser_kwargs=dict(cfg.parser_kwargs),
        tool_timeout_s=cfg.tool_timeout_s,
        tool_max_chars=cfg.tool_max_chars,
        max_tool_calls_per_turn=cfg.max_tool_calls_per_turn,
        tool_response_role=cfg.tool_response_role,
        eos_ids=[int(x) for x in cfg.eos_ids],
        sticky_sessions=cfg.sticky_sessions,
    )
    tools = [load_tool(spec) for spec in cfg.tools]
    return ToolAgentLoop(client, tokenizer, rewards, sampling, tools=tools, config=loop_cfg, **kw)


# name -> factory(agent_cfg, client, tokenizer, rewards, sampling, **loop keywords)
AGENT_LOOPS: Registry[Callable[..., Any]] = Registry(
    "agent loop", entry_point_group="offbeat.agent_loops"
)
AGENT_LOOPS.register("single_turn", _single_turn)
AGENT_LOOPS.register("tool", _tool)


class AgentLoopRouter:
    """`sample(uid, row, n, sampling)` by the row's `agent_name` (else `default`)."""

    def __init__(
        self, build: Callable[[str], Any], default: str, *, key: str = "agent_name"
    ) -> None:
        self._build = build
        self.default = default
        self.key = key
        self.loops: dict[str, Any] = {default: build(default)}

    def loop(self, name: str | None = None) -> Any:
        name = name or self.default
        if name not in self.loops:
            self.loops[name] = self._build(name)
        return self.loops[name]

    def loop_for(self, row: Mapping[str, Any]) -> Any:
        return self.loop(row.get(self.key) if hasattr(row, "get") else None)

    async def sample(self, uid: str, row: Mapping[str, Any], n: int, sampling=None) -> list:
        from offbeat.core.trainer.agent_loop import GroupFailed

        try:
            loop = self.loop_for(row)
        except Exception as e:  # an unknown agent_name, a tool that does not load
            raise GroupFailed(f"no agent loop for this row: {type(e).__name__}: {e}") from e
        return await loop.sample(uid, row, n, sampling)


def build_agent(
    cfg: AgentConfig, client: Any, tokenizer: Any, rewards: Any, sampling: Mapping[str, Any], **kw
) -> AgentLoopRouter:
    """The job's agent: a router over the registered loops, each built with the same
    client, tokenizer, rewards, base sampling and loop keywords (`prompt_key`,
    `max_prompt_length`, `on_engine_error`, ...)."""

    def build(name: str) -> Any:
        return AGENT_LOOPS.get(name)(cfg, client, tokenizer, rewards, dict(sampling), **kw)

    return AgentLoopRouter(build, cfg.default)


# ---- config rules (run by offbeat.core.config.validate) ---------------------------------
@check
def _agent_rules(cfg: JobConfig, p: Problems) -> None:
    a = getattr(cfg, "agent", None)
    if a is None:
        return
    from offbeat.core.agent.parsers import TOOL_PARSERS
    from offbeat.core.agent.tools import load_tool

    p.require_registered("agent.default", a.default, AGENT_LOOPS)
    p.require_int("agent.max_turns", a.max_turns)
    p.require_int("agent.max_tokens_per_turn", a.max_tokens_per_turn, minimum=0)
    p.require_int("agent.max_tool_calls_per_turn", a.max_tool_calls_per_turn)
    p.require_number("agent.tool_timeout_s", a.tool_timeout_s, low=1e-3)
    p.require_int("agent.tool_max_chars", a.tool_max_chars)
    p.require_registered("agent.tool_parser", a.tool_parser, TOOL_PARSERS)
    for spec in a.tools:
        try:
            load_tool(spec)
        except Exception as e:
            p.add("agent.tools", spec, f"a registered tool name or 'pkg.mod:fn' ({e})")
    if a.default == "tool" and not a.tools:
        p.add("agent.tools", list(a.tools), "at least one tool when agent.default=tool")
