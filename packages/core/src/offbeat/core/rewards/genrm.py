"""GenRM: an LLM judge as the reward, scored over an OpenAI-compatible completions endpoint.

Knows the judge prompt template, how a score is parsed out of the judge's verdict, and how
calls are bounded (concurrency, per-call timeout, retries) and de-duplicated within a step.
Does not know where the judge runs (a URL, or replicas started elsewhere), the policy, or
the trainer: `GenRMJudge.score` is awaited per finished trajectory by whoever holds it.
The HTTP transport is injectable (`post(url, payload, timeout) -> dict`) so tests use a
fake judge; the default one uses aiohttp, imported lazily.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from offbeat.core.config.validation import Problems, check
from offbeat.core.registry import REWARD_FUNCTIONS
from offbeat.core.rewards.registry import RewardError, call_reward_fn, register_reward

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

Post = Callable[[str, dict, float], Awaitable[dict]]

DEFAULT_TEMPLATE = (
    "Grade the answer to the question.\nQuestion: {question}\nAnswer: {response}\n"
    "{reference_line}Reply with a short verdict, then a score from {low} to {high}."
)
_INT = re.compile(r"-?\d+")
ON_PARSE_FAILURE = ("zero", "fail")
VAL_REWARD = ("judge", "task")  # validation scored by the judge, or by each row's rule scorer


@dataclass
class GenRMConfig:
    """`reward.genrm.*`; every key is used (see `validate_genrm`)."""

    url: str = ""
    model: str = "judge"
    template: str = DEFAULT_TEMPLATE
    score_min: int = 0
    score_max: int = 10
    score_regex: str = ""  # one group: the score; overrides the default last-integer rule
    on_parse_failure: str = "zero"  # "zero": score 0 and count; "fail": RewardError
    max_concurrency: int = 8
    timeout_s: float = 30.0
    retries: int = 2
    max_tokens: int = 64
    weights: dict[str, float] = field(default_factory=dict)  # data_source -> judge weight
    replicas: int = 0  # judge replicas to start (genrm_replicas.start_judges); 0: use url
    model_path: str = ""  # the judge model the replicas serve (a directory, offbeat-tiny:<size>)
    tensor_parallel_size: int = 1  # per judge replica
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # over rollout.engine_kwargs
    judge_cpus: list[int] = field(default_factory=list)  # []: share runtime.rollout_cpus
    judge_num_cpus: float = 0.5  # Ray CPUs per judge replica actor
    val_reward: str = "judge"  # "task": validation scores rows by their data_source's rule


def validate_genrm(raw: Mapping[str, Any], p: Problems, prefix: str = "reward.genrm") -> None:
    """Report every bad `reward.genrm` key with its value and what is valid."""
    known = set(GenRMConfig.__dataclass_fields__)
    for k in raw:
        if k not in known:
            p.add(f"{prefix}.{k}", raw[k], f"one of {sorted(known)}")
    get = {**GenRMConfig().__dict__, **dict(raw)}
    for k in ("max_concurrency", "max_tokens"):
        p.require_int(f"{prefix}.{k}", get[k], minimum=1)
    p.require_int(f"{prefix}.retries", get["retries"], minimum=0)
    p.require_int(f"{prefix}.replicas", get["replicas"], minimum=0)
    p.require_int(f"{prefix}.tensor_parallel_size", get["tensor_parallel_size"], minimum=1)
    if isinstance(get["replicas"], int) and get["replicas"] > 0 and not get["model_path"]:
        p.add(f"{prefix}.model_path", get["model_path"], "the judge model's path (replicas > 0)")
    for k in ("score_min", "score_max"):
        p.require_int(f"{prefix}.{k}", get[k], minimum=None)
    lo, hi = get["score_min"], get["score_max"]
    if isinstance(lo, int) and isinstance(hi, int) and hi <= lo:
        p.add(f"{prefix}.score_max", hi, f"an integer above score_min={lo}")
    t = get["timeout_s"]
    if isinstance(t, bool) or not isinstance(t, int | float) or t <= 0:
        p.add(f"{prefix}.timeout_s", t, "a positive number of seconds")
    if get["val_reward"] not in VAL_REWARD:
        p.add(f"{prefix}.val_reward", get["val_reward"], f"one of {VAL_REWARD}")
    n = get["judge_num_cpus"]
    if isinstance(n, bool) or not isinstance(n, int | float) or n < 0:
        p.add(f"{prefix}.judge_num_cpus", n, "a number of Ray CPUs >= 0")
    cpus = get["judge_cpus"]
    if not isinstance(cpus, list | tuple) or any(
        isinstance(c, bool) or not isinstance(c, int) for c in cpus
    ):
        p.add(f"{prefix}.judge_cpus", cpus, "a list of core ids ([]: runtime.rollout_cpus)")
    if get["on_parse_failure"] not in ON_PARSE_FAILURE:
        p.add(f"{prefix}.on_parse_failure", get["on_parse_failure"], f"one of {ON_PARSE_FAILURE}")
    if get["score_regex"]:
        try:
            if re.compile(get["score_regex"]).groups != 1:
                p.add(f"{prefix}.score_regex", get["score_regex"], "a regex with one group")
        except re.error as e:
            p.add(f"{prefix}.score_regex", get["score_regex"], f"a valid regex ({e})")
    for k in ("question", "response"):
        if "{" + k + "}" not in str(get["template"]):
            p.add(f"{prefix}.template", get["template"], f"a template holding {{{k}}}")
    if not isinstance(get["url"], str):
        p.add(f"{prefix}.url", get["url"], "an http(s) URL of an OpenAI-compatible server, or ''")
    for src, w in dict(get["weights"] or {}).items():
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w <= 1:
            p.add(f"{prefix}.weights.{src}", w, "a number in [0, 1]")


@check
def _check_genrm(cfg: JobConfig, p: Problems) -> None:
    """`reward.genrm` keys; with `reward.name=genrm` a judge endpoint must be set or started."""
    raw = dict(getattr(cfg.reward, "genrm", None) or {})
    validate_genrm(raw, p)
    if cfg.reward.name == "genrm" and not raw.get("url") and not raw.get("replicas"):
        p.add("reward.genrm.url", raw.get("url", ""), "a judge URL, or reward.genrm.replicas >= 1")
    path = raw.get("model_path")
    if raw.get("replicas") and isinstance(path, str) and path:
        from pathlib import Path

        from offbeat.core.models import TINY_MODEL_PRESETS

        size = path.partition("offbeat-tiny:")[2]
        tiny = path.startswith("offbeat-tiny:") and size in TINY_MODEL_PRESETS
        if not tiny and not Path(path).is_dir():
            p.add("reward.genrm.model_path", path, "an existing HF model directory or "
                  f"offbeat-tiny:<size> with size in {sorted(TINY_MODEL_PRESETS)}")  # fmt: skip


def from_config(raw: Mapping[str, Any]) -> GenRMConfig:
    """A `GenRMConfig` from a validated `reward.genrm` mapping."""
    out = GenRMConfig(**{k: v for k, v in dict(raw).items()})
    out.weights = {str(k): float(v) for k, v in dict(out.weights or {}).items()}
    out.engine_kwargs, out.judge_cpus = dict(out.engine_kwargs), list(out.judge_cpus)
    return out


def parse_score(text: str, cfg: GenRMConfig) -> float | None:
    """The judge's score normalised to [0, 1], or None when none is found: the regex's group
    when `score_regex` is set, else the last integer in range in the final paragraph."""
    lo, hi = cfg.score_min, cfg.score_max
    if cfg.score_regex:
        m = re.findall(cfg.score_regex, text)
        cands = [int(x) for x in m if _INT.fullmatch(x.strip())] if m else []
    else:
        paras = [q for q in re.split(r"\n\s*\n", text.strip()) if q.strip()]
        cands = [int(x) for x in _INT.findall(paras[-1])] if paras else []
    cands = [c for c in cands if lo <= c <= hi]
    return None if not cands else (cands[-1] - lo) / (hi - lo)


def render_prompt(cfg: GenRMConfig, question: str, response: str, reference: str | None,
                  tokenizer: Any = None) -> str:  # fmt: skip
    """The judge prompt; through the judge tokenizer's chat template when one is given."""
    ref_line = f"Reference answer: {reference}\n" if reference else ""
    body = cfg.template.format(question=question, response=response, reference=reference or "",
                               reference_line=ref_line, low=cfg.score_min, high=cfg.score_max)  # fmt: skip
    if tokenizer is None:
        return body
    msgs = [{"role": "user", "content": body}]
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


async def aiohttp_post(url: str, payload: dict, timeout: float) -> dict:
    import aiohttp

    url = url.rstrip("/") + "/v1/completions"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
        s.post(url, json=payload) as r,
    ):
        r.raise_for_status()
        return await r.json()


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


class GenRMJudge:
    """Scores responses with the judge; one instance per run, `new_step()` between steps."""

    def __init__(self, cfg: GenRMConfig, *, post: Post = aiohttp_post, tokenizer: Any = None,
                 urls: list[str] | None = None) -> None:  # fmt: skip
        self.cfg, self._post, self.tokenizer = cfg, post, tokenizer
        self.urls = list(urls or ([cfg.url] if cfg.url else []))
        if not self.urls:
            raise RewardError("genrm: no judge endpoint (reward.genrm.url or started replicas)")
        self._sem = asyncio.Semaphore(cfg.max_concurrency)
        self._next = 0
        self.new_step()

    def new_step(self) -> None:
        self._cache: dict[tuple[str, str, str], asyncio.Future] = {}
        self.latencies: list[float] = []
        self.judgments = self.parse_failures = self.cache_hits = self.errors = 0
        self._agree: list[bool] = []
        self._scores: list[float] = []  # every scored response (cache hits too)
        self._rules: list[float] = []
        # On the answers the rule scores right: did the judge too? (A judge that says
        # "wrong" to everything agrees with the rule on every wrong answer, and here on
        # none: with few right answers the agreement alone hides it.)
        self._right: list[bool] = []
        self._t0 = time.monotonic()

    async def _call(self, prompt: str) -> str:
        payload = {"model": self.cfg.model, "prompt": prompt, "max_tokens": self.cfg.max_tokens,
                   "temperature": 0.0}  # fmt: skip
        last: Exception | None = None
        # A transport over replicas (`BalancedJudgeTransport`) can say, after a failure,
        # when a replica serves again (a dead one's replacement joined): the retry waits
        # for that outside the per-call timeout, or stops when none is left.
        settle = getattr(self._post, "settle", None)
        tries = 0
        while tries <= self.cfg.retries:
            url = self.urls[self._next % len(self.urls)]
            self._next += 1
            tries += 1
            t = time.monotonic()
            try:
                async with self._sem:
                    out = await asyncio.wait_for(self._post(url, payload, self.cfg.timeout_s),
                                                 self.cfg.timeout_s)  # fmt: skip
                self.latencies.append(time.monotonic() - t)
                return out["choices"][0]["text"]
            except Exception as e:  # timeout, refused, bad body: try the next replica
                self.errors += 1
                last = e
            if settle is not None and not await settle():
                break  # no replica left and none on its way
        raise RewardError(f"genrm: judge failed {tries} times: {last!r}")

    async def _judge(self, prompt: str) -> float:
        text = await self._call(prompt)
        self.judgments += 1
        score = parse_score(text, self.cfg)
        if score is None:
            self.parse_failures += 1
            if self.cfg.on_parse_failure == "fail":
                raise RewardError(f"genrm: no score in the judge's verdict {text[-200:]!r}")
            return 0.0
        return score

    async def score(self, question: str, response: str, reference: str | None = None, *,
                    data_source: str = "", rule_reward: float | None = None) -> float:  # fmt: skip
        """The reward: judge score, mixed with `rule_reward` by the data_source's weight."""
        key = (question, response, reference or "")
        fut = self._cache.get(key)
        if fut is None:
            prompt = render_prompt(self.cfg, question, response, reference, self.tokenizer)
            fut = self._cache[key] = asyncio.ensure_future(self._judge(prompt))
        else:
            self.cache_hits += 1
        judged = await asyncio.shield(fut)
        self._scores.append(judged)
        if rule_reward is not None:
            self._rules.append(rule_reward)
            self._agree.append((judged >= 0.5) == (rule_reward >= 0.5))
            if rule_reward >= 0.5:
                self._right.append(judged >= 0.5)
        w = self.cfg.weights.get(data_source, 1.0)
        if rule_reward is None or w >= 1.0:
            return judged
        return w * judged + (1.0 - w) * rule_reward

    @property
    def removed_replicas(self) -> list[str]:
        """Judge replicas the transport removed after a failed call (none over a URL)."""
        return list(getattr(self._post, "removed", []))

    @property
    def replaced_replicas(self) -> dict[str, str]:
        """Dead judge replica -> the replacement that serves in its place."""
        return dict(getattr(self._post, "replaced", {}))

    def metrics(self) -> dict[str, float]:
        dt = max(time.monotonic() - self._t0, 1e-9)
        out = {
            "genrm/latency_p50_s": _pct(self.latencies, 0.5),
            "genrm/latency_p99_s": _pct(self.latencies, 0.99),
            "genrm/judgments_per_s": self.judgments / dt,
            "genrm/judgments": float(self.judgments),
            "genrm/parse_failures": float(self.parse_failures),
            "genrm/cache_hits": float(self.cache_hits),
            "genrm/errors": float(self.errors),
        }
        if self._scores:
            out["genrm/score_mean"] = sum(self._scores) / len(self._scores)
        if self._agree:
            out["genrm/agreement_with_rule"] = sum(self._agree) / len(self._agree)
            out["genrm/rule_reward_mean"] = sum(self._rules) / len(self._rules)
        if self._right:
            out["genrm/agreement_on_right"] = sum(self._right) / len(self._right)
        return out


# The registry's `genrm` scorer: sync, called from the agent loop's scoring worker thread;
# it hands the call to the judge on the event loop that owns it (installed by `install`).
_INSTALLED: dict[str, Any] = {}


def install(judge: GenRMJudge | None, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Make `judge` (on `loop`, default the running one) the one `genrm` scores with."""
    _INSTALLED.clear()
    if judge is not None:
        _INSTALLED.update(judge=judge, loop=loop or asyncio.get_running_loop())


def _rule(source: str, response: str, ground_truth: Any) -> float | None:
    """The row's own rule reward (its data_source's scorer), or None where there is none."""
    if not source or source == "genrm" or source not in REWARD_FUNCTIONS:
        return None
    try:
        return float(call_reward_fn(REWARD_FUNCTIONS.get(source), response, ground_truth))
    except Exception:  # the rule scorer is only a comparison here
        return None


def _on_judge_loop(responses: list[str], ground_truth: Any, kw: dict[str, Any]) -> list[float]:
    """Score `responses` (one prompt's group) at once on the installed judge's loop; blocks
    the calling worker thread, never the loop."""
    if not _INSTALLED:
        raise RewardError(
            "genrm: no judge installed (start judge replicas or set reward.genrm.url)"
        )
    judge, loop = _INSTALLED["judge"], _INSTALLED["loop"]
    question = str(dict(kw.get("extra_info") or {}).get("question", ""))
    source = str(kw.get("data_source", ""))
    ref = None if ground_truth is None else str(ground_truth)

    async def group() -> list[float]:
        return list(await asyncio.gather(*(
            judge.score(question, r, ref, data_source=source, rule_reward=_rule(source, r, ground_truth))
            for r in responses
        )))  # fmt: skip

    return asyncio.run_coroutine_threadsafe(group(), loop).result()


@register_reward("genrm")
def genrm_reward(response: str, ground_truth: Any, **kw: Any) -> float:
    """The installed judge's score of `response` to `extra_info["question"]`, with
    `ground_truth` as the reference; the row's own rule reward (its data_source's scorer,
    when registered) is passed along for the weights and the agreement metric."""
    return _on_judge_loop([response], ground_truth, kw)[0]


def _genrm_group(responses: list[str], ground_truth: Any, **kw: Any) -> list[float]:
    """A group's responses judged concurrently (`RewardRegistry.score_group` calls it)."""
    return _on_judge_loop(list(responses), ground_truth, kw)


genrm_reward.score_group = _genrm_group  # type: ignore[attr-defined]
# The judge bounds its own time (reward.genrm.timeout_s per request, with retries), so
# reward.timeout_s does not cut it; the ground truth is only an optional reference.
genrm_reward.own_timeout = True  # type: ignore[attr-defined]
genrm_reward.ground_truth_optional = True  # type: ignore[attr-defined]
