"""Do per-sample requests of one prompt share its prefill the way the samples of one
group request (vLLM's `n`) do? Prompt tokens served from vLLM's prefix cache, per request.

vLLM v1 turns a request of `n` samples into `n` requests inside the engine, which share
the prompt's KV only through the prefix cache, in full KV blocks. This script sends 8
single requests of the same prompt, all at once (as a batch of per-sample requests
arrives) and one after another, for prompts shorter than a KV block and longer than one,
and prints `num_cached_tokens` of each: the prompt tokens it did not prefill. A group's
samples can share no more than the per-sample requests do here.

    uv run --frozen --no-sync python benchmarks/rollout_prefix_sharing.py \
        [--lengths 27 70 150] [-- key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


async def main(args: argparse.Namespace) -> None:
    from offbeat.core.cli import load_recipe_config
    from offbeat.core.models.resolve import resolve_model
    from offbeat.rollout_vllm.replica import engine_kwargs_of
    from offbeat.rollout_vllm.server import VLLMRolloutServer, VLLMServerConfig

    _, cfg = load_recipe_config("separate_async", args.overrides)
    model = resolve_model(cfg.model.path, Path(tempfile.gettempdir()) / "offbeat-bench-models")
    kw = engine_kwargs_of(cfg)
    kw["max_model_len"] = max(kw.get("max_model_len", 0), max(args.lengths) + 8)
    server = VLLMRolloutServer(VLLMServerConfig(model=str(model), engine_kwargs=kw))
    cache = server.engine.vllm_config.cache_config
    print(
        f"model {cfg.model.path}, engine {kw}; KV block {cache.block_size} tokens, "
        f"prefix caching {cache.enable_prefix_caching}"
    )
    params = {"temperature": 1.0, "max_tokens": 4}
    vocab = server._vocab_size
    try:
        for length in args.lengths:
            for how in ("at once", "one after another"):
                prompt = [(7 * i + 13 * length + len(how)) % (vocab - 3) + 3 for i in range(length)]
                tag = f"{length}-{how.replace(' ', '')}"
                if how == "at once":
                    outs = await asyncio.gather(
                        *(server.generate(f"{tag}-{i}", prompt, params) for i in range(8))
                    )
                else:
                    outs = [await server.generate(f"{tag}-{i}", prompt, params) for i in range(8)]
                cached = [o.extra["num_cached_tokens"] for o in outs]
                print(
                    f"prompt {length:>4} tokens, 8 per-sample requests {how:<17}: prompt tokens "
                    f"from the prefix cache {cached} ({sum(cached)} of {8 * length})"
                )
    finally:
        server.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[27, 70, 150])
    ap.add_argument("overrides", nargs="*", help="job config overrides (key=value)")
    asyncio.run(main(ap.parse_args()))
