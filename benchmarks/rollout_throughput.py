"""Figure 1 of offbeat-rollout-vllm: generation throughput through the full offbeat path
(PartialRolloutClient -> AsyncLoadBalancer -> VLLMRolloutServer) against raw vLLM
`AsyncLLM.generate` on the same engine and the same prompts, in the same run.

Runs alternate (raw then offbeat, offbeat then raw, ...) after a warm-up. The table gives
the median and best of each, the median of the paired ratios, and the CPU time the
front-end process (where offbeat's code runs) spent per 1k tokens: on a shared machine the
last is the figure least disturbed by other load. "raw, same params" gives vLLM exactly the SamplingParams the adapter
sends (token ids only, the sampled token's log-prob, final output only): the ratio against
it is offbeat's overhead. "raw, vLLM defaults" (detokenised, cumulative outputs) is shown
for context.

    python benchmarks/rollout_throughput.py [--prompts 256] [--max-tokens 32] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(rng.randrange(16, 65))] for _ in range(n)]


async def run_raw(engine, prompts, max_tokens: int, same_params: bool, tag: str):
    """Returns (tokens/s, frontend CPU seconds)."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    if same_params:
        sp = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    else:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, p: list[int]) -> int:
        last = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=p), sp, f"{tag}-{i}"):
            last = out
        return len(last.outputs[0].token_ids)

    t0, c0 = time.perf_counter(), time.process_time()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert sum(counts) == len(prompts) * max_tokens
    return sum(counts) / dt, cpu


async def run_offbeat(client, prompts, max_tokens: int, tag: str):
    """Returns (tokens/s, frontend CPU seconds)."""
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    t0, c0 = time.perf_counter(), time.process_time()
    outs = await asyncio.gather(
        *(client.generate(f"{tag}-{i}", p, params) for i, p in enumerate(prompts))
    )
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(o.token_ids) for o in outs)
    assert n == len(prompts) * max_tokens
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
    return n / dt, cpu


async def main(args: argparse.Namespace) -> None:
    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.models import build_tiny_model, tiny_model_num_parameters
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig

    model = build_tiny_model(size=args.size)
    server = VLLMRolloutServer(
        VLLMServerConfig(
            model=str(model),
            engine_kwargs={
                "max_model_len": 256,
                "dtype": "float32",
                "enforce_eager": True,
                "max_num_seqs": args.prompts,
                "disable_log_stats": True,
            },
        )
    )
    client = PartialRolloutClient(
        AsyncLoadBalancer({server.server_id: server}),
        PartialRolloutConfig(max_tokens=args.max_tokens),
    )
    prompts = make_prompts(args.prompts)
    await run_raw(server.engine, prompts, args.max_tokens, True, "warm")  # warm-up
    await run_offbeat(client, prompts, args.max_tokens, "warm")
    runs: dict[str, list[tuple[float, float]]] = {"raw": [], "offbeat": [], "default": []}
    for r in range(args.repeats):
        # Alternate which goes first so a load change on the machine hits both alike.
        pair = [
            ("raw", lambda r=r: run_raw(server.engine, prompts, args.max_tokens, True, f"raw{r}")),
            ("offbeat", lambda r=r: run_offbeat(client, prompts, args.max_tokens, f"ob{r}")),
        ]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            runs[name].append(await fn())
        runs["default"].append(
            await run_raw(server.engine, prompts, args.max_tokens, False, f"rawd{r}")
        )
    server.shutdown()

    med = statistics.median
    tps = {k: [x for x, _ in v] for k, v in runs.items()}
    cpu = {k: [c for _, c in v] for k, v in runs.items()}
    ratios = [o / r for o, r in zip(tps["offbeat"], tps["raw"], strict=True)]
    n_tokens = args.prompts * args.max_tokens
    print()
    print(
        f"model: tiny random Qwen2 '{args.size}' ({tiny_model_num_parameters(args.size) / 1e6:.1f}M"
        f" params, float32), vLLM-cpu, {os.cpu_count()} CPUs (shared; load avg "
        f"{os.getloadavg()[0]:.1f}); {args.prompts} prompts of 16-64 tokens x {args.max_tokens}"
        f" new tokens; {args.repeats} alternating runs"
    )
    print(f"{'path':<40}{'median tok/s':>13}{'best tok/s':>12}{'frontend CPU ms/1k tok':>24}")
    rows = [
        ("raw AsyncLLM.generate, same params", "raw"),
        ("client + balancer + adapter (offbeat)", "offbeat"),
        ("raw AsyncLLM.generate, vLLM defaults", "default"),
    ]
    for label, key in rows:
        print(
            f"{label:<40}{med(tps[key]):>13.0f}{max(tps[key]):>12.0f}"
            f"{1e3 * med(cpu[key]) / (n_tokens / 1e3):>24.1f}"
        )
    print(
        f"\noffbeat / raw (same params): median of paired runs {med(ratios):.1%}, "
        f"best vs best {max(tps['offbeat']) / max(tps['raw']):.1%}  (target >= 90%)"
    )
    print("paired ratios: " + ", ".join(f"{x:.0%}" for x in ratios))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--size", default="tiny")
    asyncio.run(main(ap.parse_args()))
