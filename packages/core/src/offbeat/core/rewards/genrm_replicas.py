"""Judge replicas for GenRM: where they are started, and the transport that routes judge
calls to them through offbeat's own LoadBalancer.

Knows how to start judge replicas from the `rollout.engine` registry entry (the one place
to move when named Ray pools land) and how to call a replica handle (`handle.generate`,
a Ray actor's `.remote` or a plain coroutine). Judges never get weight syncs: nothing
here registers them with the checkpoint engine. Knows nothing of the trainer; a replica
that fails a call is removed from the balancer and the judge's retry goes to another.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from offbeat.core.rewards.genrm import GenRMConfig


def start_judges(cfg: Any, model_dir: str, n: int) -> dict[str, Any]:
    """Start `n` judge replicas of `model_dir` (not awaited), like the rollout replicas."""
    from offbeat.core.registry import ROLLOUT_ENGINES

    factory = ROLLOUT_ENGINES.get(cfg.rollout.engine)
    return {f"judge-{i}": factory(cfg, model_dir, 1000 + i) for i in range(n)}


def start_configured_judges(cfg: Any) -> dict[str, Any]:
    """The replicas `reward.genrm.replicas` / `reward.genrm.model_path` ask for ({} for 0)."""
    raw = dict(cfg.reward.genrm or {})
    n = int(raw.get("replicas", 0))
    return start_judges(cfg, str(raw["model_path"]), n) if n > 0 else {}


class BalancedJudgeTransport:
    """A `Post` for `GenRMJudge` (its url argument is ignored): tokenises the prompt with
    the judge tokenizer, leases a replica from the balancer, generates, detokenises."""

    def __init__(self, servers: Mapping[str, Any], tokenizer: Any, cfg: GenRMConfig) -> None:
        from offbeat.balancer import LoadBalancer

        self.balancer = LoadBalancer(dict(servers))
        self.handles = dict(servers)
        self.tokenizer, self.cfg = tokenizer, cfg
        self.removed: list[str] = []
        self._ids = itertools.count()

    async def __call__(self, url: str, payload: dict, timeout: float) -> dict:
        rid = f"judge-{next(self._ids)}"
        prompt_ids = self.tokenizer.encode(payload["prompt"], add_special_tokens=False)
        params = {"max_tokens": payload["max_tokens"], "temperature": 0.0}
        lease = self.balancer.acquire(rid)
        sid = lease.server_id
        try:
            generate = self.handles[sid].generate
            if hasattr(generate, "remote"):  # a Ray actor handle
                out = await generate.remote(rid, prompt_ids, params)
            else:
                out = await generate(rid, prompt_ids, params)
        except Exception:
            self.balancer.remove_servers([sid])
            self.removed.append(sid)
            raise
        finally:
            self.balancer.release(lease)
        text = self.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
        return {"choices": [{"text": text}]}


def setup_judge(cfg: Any, servers: Mapping[str, Any] | None = None, *, post: Any = None) -> Any:
    """The job's one hook, called on its event loop: build the `GenRMJudge` that
    `reward.genrm` describes (over `servers` from `start_configured_judges`, else the url),
    install it for the registry's `genrm` scorer and return it (the caller calls
    `judge.new_step()` per step and logs `judge.metrics()`). None unless reward.name=genrm."""
    from offbeat.core.rewards import genrm

    if cfg.reward.name != "genrm":
        return None
    gcfg = genrm.from_config(cfg.reward.genrm or {})
    tokenizer = None
    if gcfg.model_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gcfg.model_path)
    if servers:
        judge = genrm.GenRMJudge(gcfg, post=BalancedJudgeTransport(servers, tokenizer, gcfg),
                                 tokenizer=tokenizer, urls=["balancer"])  # fmt: skip
    else:
        judge = genrm.GenRMJudge(gcfg, post=post or genrm.aiohttp_post, tokenizer=tokenizer)
    genrm.install(judge)
    return judge
