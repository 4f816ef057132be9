"""Token-exact multi-turn trajectories: the chat template's turn layout, learnt once per
tokenizer, and the builder that lays a conversation out as token ids and a loss mask.

Knows nothing about engines, tools or rewards. Three rules make a trajectory equal, token
for token, to the chat template's rendering of the whole conversation:

* assistant tokens are kept exactly as sampled (never decoded and re-encoded);
* what the template adds around a turn comes from the template itself: after an assistant
  turn, the *turn separator* (e.g. Qwen's newline after `<|im_end|>`, nothing for
  Llama-3's `<|eot_id|>`), derived by rendering a two-turn conversation and diffing; a
  turn cut by length first gets the template's end-of-turn token;
* tool and observation tokens are the template's *delta*: the rendering of a fixed
  conversation plus the new messages, minus the rendering of the fixed conversation.

The response mask is 1 on sampled (policy) tokens only; rollout log-probs are the
sampled ones there and 0 on template tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TemplateError", "TrajectoryBuilder", "TurnTemplate", "eos_token_ids"]

# The fixed conversation deltas are taken against. Plain words: no template treats them
# specially, and their tokens end well before the turn boundary.
_PROBE_USER = "Hello there."
_PROBE_ASSISTANT = "General Kenobi."


class TemplateError(ValueError):
    """The chat template does not compose turn by turn the way a token-exact trajectory
    needs (the message says which rendering broke the rule)."""


def eos_token_ids(tokenizer: Any, extra: int | Sequence[int] | None = None) -> list[int]:
    """Every end-of-sequence id: the tokenizer's `eos_token_id` (an int or a list) and
    `extra` (e.g. a model's `generation_config.eos_token_id`, often a list), in order,
    each once."""
    out: list[int] = []
    for value in (getattr(tokenizer, "eos_token_id", None), extra):
        items = value if isinstance(value, list | tuple) else [value]
        for v in items:
            if v is not None and int(v) not in out:
                out.append(int(v))
    return out


def _render_text(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **kwargs,
    )


def _render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The template's text for `messages`, encoded without extra special tokens (the
    template writes its own), as `encode_prompt` does for prompts."""
    text = _render_text(
        tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


class TurnTemplate:
    """The turn layout of one tokenizer's chat template.

    `end_of_turn_id`: the end-of-sequence token the template closes an assistant turn with
    (one of `eos_ids`); `separator`: the ids the template writes after it. Both are
    derived once, at construction. `eos_ids`: every id that ends generation (an int or a
    list; default the tokenizer's). Tokenizer calls are serialised by `lock` (HF
    tokenizers are not documented thread-safe); pass the agent loop's to share it.
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_ids: int | Sequence[int] | None = None,
        *,
        lock: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.lock = lock if lock is not None else threading.Lock()
        self.eos_ids = eos_token_ids(tokenizer, eos_ids)
        if not self.eos_ids:
            raise TemplateError(
                "the tokenizer has no eos_token_id and no eos ids were given: the end of an "
                "assistant turn cannot be found"
            )
        with self.lock:
            self.end_of_turn_id, self.separator = self._derive_turn_end()
            self._probe = [
                {"role": "user", "content": _PROBE_USER},
                {"role": "assistant", "content": _PROBE_ASSISTANT},
            ]
            self._probe_ids = _render(tokenizer, self._probe, add_generation_prompt=False)

    def _derive_turn_end(self) -> tuple[int, list[int]]:
        """Render [user] with the assistant turn opened and [user, assistant]: the second
        is the first plus the assistant's content, its end-of-turn token and the
        separator. The separator is what follows the last eos id of that difference."""
        user = [{"role": "user", "content": _PROBE_USER}]
        opened = _render(self.tokenizer, user, add_generation_prompt=True)
        closed = _render(
            self.tokenizer,
            [*user, {"role": "assistant", "content": _PROBE_ASSISTANT}],
            add_generation_prompt=False,
        )
        if closed[: len(opened)] != opened:
            raise TemplateError(
                "the chat template's rendering of [user] with add_generation_prompt=True is "
                "not a prefix of its rendering of [user, assistant]: the assistant turn "
                "cannot be cut out of the conversation"
            )
        tail = closed[len(opened) :]
        ends = [i for i, t in enumerate(tail) if t in self.eos_ids]
        if not ends:
            raise TemplateError(
                f"the chat template closes an assistant turn with none of the eos ids "
                f"{self.eos_ids}: pass the model's end-of-turn id(s) as eos_ids"
            )
        return tail[ends[-1]], tail[ends[-1] + 1 :]

    # ---- renderings -------------------------------------------------------------------
    def prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The prompt: `messages` (and the tool schemas, where the template shows them)
        with the assistant turn opened."""
        with self.lock:
            return _render(self.tokenizer, messages, add_generation_prompt=True, tools=tools)

    def prompt_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """`prompt_ids`' text, not encoded: a prompt with images goes through the
        model's processor from it (each image placeholder widened to its tokens)."""
        with self.lock:
            return _render_text(self.tokenizer, messages, add_generation_prompt=True, tools=tools)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The template's ids of a whole conversation (what tests compare against)."""
        with self.lock:
            return _render(
                self.tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools
            )

    def closing_ids(self, sampled: Sequence[int]) -> list[int]:
        """What closes an assistant turn whose sampled tokens are `sampled`: the
        separator after a sampled end-of-turn, else the end-of-turn token and the
        separator (a turn cut by length)."""
        if sampled and sampled[-1] in self.eos_ids:
            return list(self.separator)
        return [self.end_of_turn_id, *self.separator]

    def observation_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids of `messages` (tool results, or a user turn) after a closed assistant
        turn, with the next assistant turn opened: the template's delta."""
        with self.lock:
            full = _render(self.tokenizer, [*self._probe, *messages], add_generation_prompt=True)
        base = self._probe_ids
        if full[: len(base)] != base:
            raise TemplateError(
                "the chat template renders a conversation differently once messages are "
                f"appended (roles {[m.get('role') for m in messages]}): observation tokens "
                "cannot be taken as a delta"
            )
        return full[len(base) :]


@dataclass
class TrajectoryBuilder:
    """A response assembled turn by turn: ids, loss mask and rollout log-probs stay aligned.

    `policy(ids, logprobs)` appends sampled tokens (mask 1, their log-probs);
    `template(ids)` appends tokens the template or a tool wrote (mask 0, log-prob 0).
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def policy(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} log-probs")
        self.response_ids.extend(int(t) for t in ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(float(x) for x in logprobs)

    def template(self, ids: Iterable[int]) -> None:
        ids = [int(t) for t in ids]
        self.response_ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    @property
    def ids(self) -> list[int]:
        """Prompt and response so far: the next turn's prompt."""
        return [*self.prompt_ids, *self.response_ids]

    def __len__(self) -> int:
        return len(self.response_ids)
