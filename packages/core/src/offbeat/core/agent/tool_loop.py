"""The tool-calling multi-turn agent loop: generate, parse tool calls, run the tools,
append their observations through the chat template, repeat.

Knows nothing about engines, balancers or weight syncs (the client hides interruptions:
a turn a weight sync cuts resumes on the new weights, and the trajectory's min/max
weight version span every turn). Every turn of a session goes to the balancer under the
session's id, so it is sticky to one replica and reuses its prefix cache. Trajectories
are token-exact (see `turns`): assistant tokens as sampled, template tokens from the
template, loss mask 1 on policy tokens only. A session stops at `max_turns`, when the
response budget (`max_tokens` of the sampling params) is spent, or at a turn that calls
no tool. Tools and tokenizer work never run on the event loop; a turn's tool calls are
in flight in the run's progress registry (stage "tool").
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from offbeat.core import progress
from offbeat.core.agent.parsers import TOOL_PARSERS, ParseResult
from offbeat.core.agent.tools import Tool, ToolResult, ToolRunner
from offbeat.core.agent.turns import TrajectoryBuilder, TurnTemplate
from offbeat.core.data import Trajectory
from offbeat.core.data.vision import MULTI_MODAL_DATA, VisionPrompt, encode_vision_text
from offbeat.core.rewards import RewardRegistry
from offbeat.core.rollout.protocol import sample_params
from offbeat.core.tasks.images import content_parts, decode_image, row_images
from offbeat.core.tasks.rows import reward_fields, row_messages
from offbeat.core.trainer.agent_loop import GroupFailed, SingleTurnAgentLoop, check_row

__all__ = ["STOP_REASONS", "ToolAgentLoop", "ToolLoopConfig"]

STOP_REASONS = ("no_tool_call", "max_turns", "budget")
_COUNTS = ("turns", "tool_calls", "parse_errors", "tool_errors", "tool_timeouts")
_COUNTS += ("tool_truncated",)
_COUNTS += ("prompt_tokens", "cached_tokens")


@dataclass
class ToolLoopConfig:
    """`max_turns`: assistant turns per session. `max_tokens_per_turn`: a cap on one
    turn's tokens (0: what is left of the response budget). `tool_parser` names a parser
    in `TOOL_PARSERS`, built with `parser_kwargs` (e.g. other tags). `eos_ids`: extra
    end-of-turn ids (a model's generation_config list) beside the tokenizer's.
    `sticky_sessions`: send every turn of a session to the balancer under the session's
    id (one replica; its prefix cache reused). `tool_timeout_s`: the deadline of one tool
    call (past it the call fails: an "error: timed out" observation). `tool_max_chars`:
    the longest observation a call gives the model (a longer one is cut there, marked, and
    counted in `agent/tool_truncated`)."""

    max_turns: int = 5
    max_tokens_per_turn: int = 0
    tool_parser: str = "hermes"
    parser_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_timeout_s: float = 5.0
    max_tool_calls_per_turn: int = 4
    tool_response_role: str = "tool"
    eos_ids: list[int] = field(default_factory=list)
    sticky_sessions: bool = True
    tool_max_chars: int = 1000

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_tool_calls_per_turn", "tool_max_chars"):
            if getattr(self, key) < 1:
                raise ValueError(f"ToolLoopConfig.{key}={getattr(self, key)}: must be >= 1")
        if self.max_tokens_per_turn < 0:
            raise ValueError(
                f"ToolLoopConfig.max_tokens_per_turn={self.max_tokens_per_turn}: must be >= 0"
            )


@dataclass
class _Session:
    """One trajectory in the making, and its counts."""

    traj: TrajectoryBuilder
    last_text: str = ""
    min_version: int | None = None
    max_version: int | None = None
    info: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0.0))

    def count(self, key: str, n: float = 1.0) -> None:
        self.info[key] = self.info.get(key, 0.0) + n


class ToolAgentLoop(SingleTurnAgentLoop):
    """Turns one dataset row into `n` scored multi-turn trajectories (sessions
    `<uid>-<i>`, generated concurrently). Same construction and errors as
    `SingleTurnAgentLoop`, plus `tools` and a `ToolLoopConfig`."""

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        rewards: RewardRegistry,
        sampling: Mapping[str, Any],
        *,
        tools: Sequence[Tool] = (),
        config: ToolLoopConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(client, tokenizer, rewards, sampling, **kwargs)
        self.config = config or ToolLoopConfig()
        self.parser = TOOL_PARSERS.get(self.config.tool_parser)(**self.config.parser_kwargs)
        self.runner = ToolRunner(
            tools, timeout_s=self.config.tool_timeout_s, max_chars=self.config.tool_max_chars
        )
        self.template = TurnTemplate(tokenizer, self.config.eos_ids, lock=self._tokenizer_lock)

    # ---- CPU work, in the loop's threads ----------------------------------------------
    def prompt(self, row: Mapping[str, Any]) -> VisionPrompt:
        """The row's prompt with the tool schemas; a row with images goes through the
        processor (placeholders widened; every turn's request sends the images)."""
        messages = row_messages(row, self.prompt_key)
        tools = self.runner.schemas() or None
        images = row_images(row)
        if images:
            if self.processor is None:
                raise GroupFailed(
                    "the row has images but the model has no processor (AutoProcessor) "
                    "to tokenise them", "prompt_error"
                )  # fmt: skip
            pil = [decode_image(im) for im in images]
            text = self.template.prompt_text(content_parts(messages), tools)
            with self._tokenizer_lock:
                prompt = encode_vision_text(self.processor, text, pil)
        else:
            prompt = VisionPrompt(self.template.prompt_ids(messages, tools), {}, [])
        ids = prompt.prompt_ids
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            raise GroupFailed(
                f"prompt has {len(ids)} tokens > data.max_prompt_length={self.max_prompt_length}",
                "prompt_too_long",
            )
        return prompt

    def _decode(self, ids: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _parse(self, ids: Sequence[int]) -> tuple[str, ParseResult]:
        text = self._decode(ids)
        return text, self.parser.parse(text)

    # ---- one session -----------------------------------------------------------------
    async def _session(
        self, sid: str, prompt: list[int], params: dict[str, Any], budget: int
    ) -> _Session:
        c = self.config
        s = _Session(TrajectoryBuilder(list(prompt)))
        for turn in range(c.max_turns):
            remaining = budget - len(s.traj)
            if remaining < 1:
                s.count("stop/budget")
                return s
            cap = min(c.max_tokens_per_turn or remaining, remaining)
            out = await self._turn(sid, turn, s.traj.ids, {**params, "max_tokens": cap})
            s.count("turns")
            s.count("prompt_tokens", len(s.traj.ids))
            s.count("cached_tokens", int(out.extra.get("num_cached_tokens") or 0))
            if MULTI_MODAL_DATA in params:  # the trainer's forward would seek an image
                self._check_no_placeholders([out])
            s.traj.policy(out.token_ids, out.logprobs)
            lo, hi = int(out.min_weight_version), int(out.max_weight_version)
            s.min_version = lo if s.min_version is None else min(s.min_version, lo)
            s.max_version = hi if s.max_version is None else max(s.max_version, hi)
            s.last_text, parsed = await self._off_loop(self._parse, out.token_ids)
            if not parsed.attempted:
                s.count("stop/no_tool_call")
                return s
            s.count("tool_calls", len(parsed.calls))
            s.count("parse_errors", len(parsed.errors))
            if turn == c.max_turns - 1:
                s.count("stop/max_turns")
                return s
            with progress.working("tool", None, f"{sid} turn {turn}, {len(parsed.calls)} calls"):
                results = await self._observe(parsed)
            s.count("tool_errors", sum(r.error for r in results))
            s.count("tool_timeouts", sum(r.timed_out for r in results))
            s.count("tool_truncated", sum(r.truncated for r in results))
            messages = [{"role": c.tool_response_role, "content": r.content} for r in results]
            closing = self.template.closing_ids(out.token_ids)
            obs = await self._off_loop(self.template.observation_ids, messages)
            if len(s.traj) + len(closing) + len(obs) >= budget:
                s.count("stop/budget")  # no room left for another assistant token
                return s
            s.traj.template([*closing, *obs])
        return s  # unreachable: the last turn returns above

    async def _turn(self, sid: str, turn: int, ids: list[int], params: dict[str, Any]) -> Any:
        request_id = f"{sid}-t{turn}"
        more = {"session_id": sid} if self.config.sticky_sessions else {}
        return await self._retrying(
            request_id, lambda: self.client.generate(request_id, ids, dict(params), **more)
        )

    async def _observe(self, parsed: ParseResult) -> list[ToolResult]:
        """The turn's observations: one per call (run concurrently, off the loop), then
        one per parse error; calls over the per-turn limit are refused, not run."""
        limit = self.config.max_tool_calls_per_turn
        results = await self.runner.run(parsed.calls[:limit])
        results += [
            ToolResult(call.name, f"error: more than {limit} tool calls in one turn", True)
            for call in parsed.calls[limit:]
        ]
        results += [ToolResult("", f"error: {e}", True) for e in parsed.errors]
        return results

    # ---- the group ---------------------------------------------------------------------
    async def sample(
        self, uid: str, row: Mapping[str, Any], n: int, sampling: Mapping[str, Any] | None = None
    ) -> list[Trajectory]:
        """`n` scored trajectories for `row`; raises `GroupFailed`."""
        check_row(row, self.prompt_key, self.rewards)
        try:
            vision_prompt = await self._off_loop(self.prompt, row)
        except GroupFailed:
            raise
        except Exception as e:
            raise GroupFailed(
                f"cannot build the prompt: {type(e).__name__}: {e}", "prompt_error"
            ) from e
        overrides = {k: v for k, v in (row.get("sampling") or {}).items() if v is not None}
        params = {**self.sampling, **overrides, **(sampling or {})}
        prompt = vision_prompt.prompt_ids
        if vision_prompt.images:  # every turn's prompt starts with the images
            params[MULTI_MODAL_DATA] = vision_prompt.multi_modal_data()
        budget = params.pop("max_tokens", None)
        budget = int(budget or params.pop("max_new_tokens", None) or 0)
        params.pop("max_new_tokens", None)
        if budget < 1:
            raise GroupFailed("the tool agent loop needs a max_tokens response budget")
        sessions = await asyncio.gather(
            *(
                self._session(f"{uid}-{i}", prompt, sample_params(params, i), budget)
                for i in range(n)
            )
        )
        source, truth, extra_info = reward_fields(row)
        # Each session's last assistant turn (the answer, not the tool calls before it).
        rewards = await self.score_texts(source, truth, [s.last_text for s in sessions], extra_info)
        return [
            Trajectory(
                prompt_ids=list(prompt),
                response_ids=s.traj.response_ids,
                rollout_log_probs=s.traj.logprobs,
                reward=reward,
                min_weight_version=int(s.min_version or 0),
                max_weight_version=int(s.max_version or 0),
                group_uid=uid,
                session_id=f"{uid}-{i}",
                response_mask=s.traj.mask,
                info=s.info,
                multi_modal=vision_prompt.model_inputs or None,
            )
            for i, (s, reward) in enumerate(zip(sessions, rewards, strict=True))
        ]
