"""Per-step metrics of multi-turn trajectories, from the `info` each one carries.

Knows nothing about how the trajectories were made: it sums and averages the numbers
the tool agent loop put in `Trajectory.info` (turns, tool calls, parse failures, tool
errors, timeouts and cut observations, prompt and prefix-cached tokens, why each session stopped).
Trajectories without `info` (single-turn ones) add nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["agent_metrics"]

_TOTALS = ("tool_calls", "parse_errors", "tool_errors", "tool_timeouts", "tool_truncated")


def agent_metrics(trajectories: Sequence[Any]) -> dict[str, float]:
    """`agent/*` metrics of one step's trajectories: per-step totals of tool calls, parse
    failures, tool errors, timeouts and observations cut to agent.tool_max_chars
    (`agent/tool_truncated`); mean turns; the fraction of sessions stopped by each reason;
    the prefix-cache hit rate (cached / prompt tokens over every turn); the fraction of
    response tokens the policy sampled. Empty without multi-turn ones."""
    infos = [t.info for t in trajectories if getattr(t, "info", None)]
    if not infos:
        return {}
    n = len(infos)
    out: dict[str, float] = {"agent/sessions": float(n)}
    for key in _TOTALS:
        out[f"agent/{key}"] = sum(i.get(key, 0.0) for i in infos)
    out["agent/turns_mean"] = sum(i.get("turns", 0.0) for i in infos) / n
    stops = sorted({k for i in infos for k in i if k.startswith("stop/")})
    for key in stops:
        out[f"agent/{key}_frac"] = sum(i.get(key, 0.0) for i in infos) / n
    prompt = sum(i.get("prompt_tokens", 0.0) for i in infos)
    if prompt > 0:
        out["agent/prefix_cache_hit_rate"] = (
            sum(i.get("cached_tokens", 0.0) for i in infos) / prompt
        )
    policy = total = 0
    for t in trajectories:
        if getattr(t, "info", None) and t.response_mask is not None:
            policy += sum(t.response_mask)
            total += len(t.response_mask)
    if total:
        out["agent/policy_token_frac"] = policy / total
    return out
