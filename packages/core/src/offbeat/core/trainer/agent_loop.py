"""The single-turn agent loop: chat template -> generate (n samples) -> reward.

Knows nothing about engines, balancers or weight syncs: it calls any client with an async
`generate(request_id, prompt_ids, sampling_params) -> TokenOutput` (the
PartialRolloutClient, which hides interruptions), and for `n > 1` its
`generate_group(request_id, prompt_ids, sampling_params, n) -> list[TokenOutput]` where the
client has one (one request per group), and a `RewardRegistry`. It never lets a
reward or engine error escape as anything but `GroupFailed`, which the rollout driver
turns into a failed (evicted, counted, refilled) group, with a `reason` the run counts
(`failed/<reason>_total`): `bad_row` (a dataset row that cannot be a prompt, checked before
anything is generated), `prompt_too_long`, `prompt_error`, `engine_error`, or a reward's
(`reward_error`, `reward_invalid`, `reward_timeout`, `reward_missing`). Its CPU work (chat
template and tokenisation of the prompt, detokenisation) runs in a small thread pool of
its own, never on the event loop; reward calls run off the loop too, each under
`reward.timeout_s` (`RewardRegistry.ascore_group`): a slow scorer delays its group, not
the rollout or the trainer, and a hung one fails its group at the deadline. A group's
reward calls are in flight in the run's progress registry (stage "reward").
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from offbeat.core import progress
from offbeat.core.data import Trajectory
from offbeat.core.data.vision import MULTI_MODAL_DATA, VisionPrompt, encode_vision_prompt
from offbeat.core.rewards import RewardError, RewardRegistry
from offbeat.core.rollout.protocol import sample_params
from offbeat.core.tasks.bad_rows import BAD_ROW, row_problem
from offbeat.core.tasks.images import content_parts, decode_image, row_images
from offbeat.core.tasks.rows import reward_fields

logger = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """A group could not be completed (a bad row, a reward function or engine error).
    `reason`: a short name the run counts failed groups by (see the module docstring)."""

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason


def check_row(row: Mapping[str, Any], prompt_key: str, rewards: Any) -> None:
    """Raise `GroupFailed` (reason `bad_row`) when `row` cannot be made a prompt and scored:
    the dataloader's mark (file and row index), else what `row_problem` finds."""
    problem = row.get(BAD_ROW) if hasattr(row, "get") else None
    if problem is None:
        needs_truth = bool(getattr(rewards, "needs_ground_truth", True))
        problem = row_problem(row, prompt_key, needs_ground_truth=needs_truth)
    if problem is not None:
        raise GroupFailed(f"bad row: {problem}", "bad_row")


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, with the
    assistant turn opened."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


class SingleTurnAgentLoop:
    """Turns one dataset row into `n` scored trajectories.

    `sampling` is the base sampling dict (e.g. temperature, max_tokens); a row may carry
    a `sampling` dict of per-prompt overrides. `on_engine_error(exc)` is awaited when a
    generate call raises (e.g. a replica died): it may heal the pool (remove the dead
    replica) and return True to retry the request, up to `max_retries` times.
    `cpu_threads`: the threads that template, detokenise and score (off the event loop).
    `processor`: the model's AutoProcessor (a vision-language model): a row with images
    is rendered and tokenised by it, its images go to the engine as `multi_modal_data`
    and its vision inputs ride on each trajectory for the trainer's forward.
    """

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        rewards: RewardRegistry,
        sampling: Mapping[str, Any],
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int | None = None,
        max_retries: int = 2,
        on_engine_error: Callable[[BaseException], Awaitable[bool]] | None = None,
        cpu_threads: int = 4,
        processor: Any | None = None,
    ) -> None:
        if cpu_threads < 1:
            raise ValueError(f"cpu_threads={cpu_threads}: must be >= 1")
        self.client = client
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.sampling = dict(sampling)
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.max_retries = max_retries
        self.on_engine_error = on_engine_error
        self.processor = processor
        self._cpu = ThreadPoolExecutor(cpu_threads, thread_name_prefix="agent-loop")
        # HF tokenizers are not documented thread-safe: one tokenizer call at a time.
        self._tokenizer_lock = threading.Lock()

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def prompt_ids(self, row: Mapping[str, Any]) -> list[int]:
        return self.prompt(row).prompt_ids

    def prompt(self, row: Mapping[str, Any]) -> VisionPrompt:
        """The row's prompt: token ids, and for a row with images (through the processor)
        the model's vision inputs and the images for the engine."""
        messages = row[self.prompt_key]
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        images = row_images(row)
        with self._tokenizer_lock:
            if images and self.processor is None:
                raise GroupFailed(
                    "the row has images but the model has no processor (AutoProcessor) "
                    "to tokenise them", "prompt_error"
                )  # fmt: skip
            if images:
                pil = [decode_image(im) for im in images]
                prompt = encode_vision_prompt(self.processor, content_parts(messages), pil)
            else:
                prompt = VisionPrompt(encode_prompt(self.tokenizer, list(messages)), {}, [])
        ids = prompt.prompt_ids
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            raise GroupFailed(
                f"prompt has {len(ids)} tokens > data.max_prompt_length={self.max_prompt_length}",
                "prompt_too_long",
            )
        return prompt

    async def _retrying(self, request_id: str, call: Callable[[], Awaitable[Any]]) -> Any:
        attempt = 0
        while True:
            try:
                return await call()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                attempt += 1
                retry = self.on_engine_error is not None and attempt <= self.max_retries
                if retry:
                    retry = await self.on_engine_error(e)
                if not retry:
                    raise GroupFailed(
                        f"generate({request_id}) failed: {type(e).__name__}: {e}", "engine_error"
                    ) from e
                logger.warning("generate(%s) failed (%s); retrying elsewhere", request_id, e)

    async def _generate(self, request_id: str, prompt_ids: list[int], sampling: dict[str, Any]):
        return await self._retrying(
            request_id, lambda: self.client.generate(request_id, prompt_ids, dict(sampling))
        )

    async def _generate_n(
        self, uid: str, prompt_ids: list[int], sampling: dict[str, Any], n: int
    ) -> list[Any]:
        """`n` responses: one group request where the client has `generate_group` (an
        engine error retries the whole group), else `n` requests `<uid>-<i>` (each retried
        alone). Sample `i` of a seeded request is seeded `seed + i` either way."""
        group = getattr(self.client, "generate_group", None)
        if n > 1 and group is not None:
            return list(
                await self._retrying(uid, lambda: group(uid, prompt_ids, dict(sampling), n))
            )
        return list(
            await asyncio.gather(
                *(
                    self._generate(f"{uid}-{i}", prompt_ids, sample_params(sampling, i))
                    for i in range(n)
                )
            )
        )

    async def sample(
        self, uid: str, row: Mapping[str, Any], n: int, sampling: Mapping[str, Any] | None = None
    ) -> list[Trajectory]:
        """`n` trajectories for `row`, each scored; raises `GroupFailed`."""
        check_row(row, self.prompt_key, self.rewards)
        try:
            prompt = await self._off_loop(self.prompt, row)
        except GroupFailed:
            raise
        except Exception as e:
            raise GroupFailed(
                f"cannot build the prompt: {type(e).__name__}: {e}", "prompt_error"
            ) from e
        # Parquet gives every row every key of the column's struct (missing ones as null):
        # a null override means "not set".
        overrides = {k: v for k, v in (row.get("sampling") or {}).items() if v is not None}
        params = {**self.sampling, **overrides, **(sampling or {})}
        prompt_ids = prompt.prompt_ids
        if prompt.images:
            params[MULTI_MODAL_DATA] = prompt.multi_modal_data()
        outs = await self._generate_n(uid, prompt_ids, params, n)
        if prompt.images:
            self._check_no_placeholders(outs)
        source, truth, extra_info = reward_fields(row)  # offbeat's or verl's row layout
        texts = await self._off_loop(self._decode_group, outs)
        rewards = await self.score_texts(source, truth, texts, extra_info)
        return [
            Trajectory(
                prompt_ids=list(prompt_ids),
                response_ids=list(out.token_ids),
                rollout_log_probs=[float(x) for x in out.logprobs],
                reward=reward,
                min_weight_version=int(out.min_weight_version),
                max_weight_version=int(out.max_weight_version),
                group_uid=uid,
                session_id=f"{uid}",
                multi_modal=prompt.model_inputs or None,
            )
            for out, reward in zip(outs, rewards, strict=True)
        ]

    def _check_no_placeholders(self, outs: Sequence[Any]) -> None:
        """A sampled image placeholder token would make the trainer's forward look for an
        image that is not there: such a group fails (reason `response_placeholder`)."""
        tok = getattr(self.processor, "tokenizer", None)
        names = [getattr(self.processor, a, None) for a in ("image_token", "video_token")]
        ids = {tok.convert_tokens_to_ids(t) for t in names if t and tok is not None}
        for out in outs:
            if ids & set(out.token_ids):
                raise GroupFailed(
                    "a response holds an image placeholder token", "response_placeholder"
                )

    def _decode_group(self, outs: Sequence[Any]) -> list[str]:
        """Detokenise a group's responses in one batch; runs in a worker thread."""
        ids = [list(out.token_ids) for out in outs]
        batch_decode = getattr(self.tokenizer, "batch_decode", None)
        with self._tokenizer_lock:
            if batch_decode is not None:
                return list(batch_decode(ids, skip_special_tokens=True))
            return [self.tokenizer.decode(x, skip_special_tokens=True) for x in ids]

    async def score_texts(
        self, source: str, truth: Any, texts: Sequence[str], extra_info: Mapping[str, Any]
    ) -> list[float]:
        """The rewards of a group's texts, each call off the loop and under the reward
        deadline (`RewardRegistry.ascore_group`); a rewards object without it is called in
        this loop's threads, as one group. Raises `GroupFailed` with the reward's reason."""
        try:
            with progress.working("reward", None, f"data_source {source!r}, {len(texts)} texts"):
                ascore = getattr(self.rewards, "ascore_group", None)
                if ascore is not None:
                    return list(await ascore(source, list(texts), truth, extra_info))
                return await self._off_loop(
                    self._score_sync, source, truth, list(texts), extra_info
                )
        except RewardError as e:
            raise GroupFailed(str(e), getattr(e, "reason", "reward_error")) from e

    def _score_sync(
        self, source: str, truth: Any, texts: list[str], extra_info: Mapping[str, Any]
    ) -> list[float]:
        group = getattr(self.rewards, "score_group", None)
        if group is not None:
            return group(source, texts, truth, extra_info)
        return [self.rewards.score(source, text, truth, extra_info) for text in texts]
