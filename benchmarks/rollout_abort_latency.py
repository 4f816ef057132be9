"""Figure 3 of offbeat-rollout-vllm: abort-to-resumed latency.

N requests decode through PartialRolloutClient -> AsyncLoadBalancer -> VLLMRolloutServer.
We call `abort_all()` (every in-flight call returns "aborted" with its tokens), then
`resume()`; the client resends prompt + tokens so far with the remaining budget. Measured:
abort_all() until every interrupted call has returned; resume(); and from abort_all() until
every interrupted request has produced its first new token again ("generating again").

Baseline, same run, same engine: the unavoidable part of a resume, i.e. raw
`AsyncLLM.generate` of the same N (prompt + partial output) sequences on the idle engine,
until each has produced one token (a re-prefill, since the KV cache is dropped with the
weights). Progress is read from vLLM's output processor, which is fine for a benchmark.

    python benchmarks/rollout_abort_latency.py [--requests 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BUDGET = 180


def states(engine, prefix: str):
    return [
        s
        for s in engine.output_processor.request_states.values()
        if str(s.external_req_id).startswith(prefix)
    ]


async def wait_for(cond, timeout: float = 120.0) -> float:
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.001)
    return time.perf_counter()


async def one_round(server, client, prompts, tag: str) -> dict:
    engine = server.engine
    params = {"temperature": 0.0, "ignore_eos": True}
    tasks = [
        asyncio.create_task(client.generate(f"{tag}-{i}", p, params)) for i, p in enumerate(prompts)
    ]
    n = len(prompts)
    # Let every request get a few tokens into its decode.
    await wait_for(
        lambda: (
            len(states(engine, tag)) == n
            and all(s.detokenizer.num_output_tokens() >= 8 for s in states(engine, tag))
        )
    )
    t0 = time.perf_counter()
    await server.abort_all()
    t_abort = time.perf_counter()
    await server.resume()
    t_resume = time.perf_counter()

    resumed_seqs: list[list[int]] = []

    def resumed_and_generating() -> bool:
        # A resumed attempt's prompt is the original prompt + the tokens kept so far.
        resumed = [s for s in states(engine, tag) if len(s.prompt_token_ids) > len(prompts[0])]
        if len(resumed) == n and all(s.detokenizer.num_output_tokens() >= 1 for s in resumed):
            resumed_seqs[:] = [list(s.prompt_token_ids) for s in resumed]
            return True
        return False

    t_gen = await wait_for(resumed_and_generating)
    outs = await asyncio.gather(*tasks)
    assert all(len(o.token_ids) == BUDGET and o.extra["num_attempts"] == 2 for o in outs)
    return {
        "abort": t_abort - t0,
        "resume": t_resume - t_abort,
        "to_generating": t_gen - t0,
        "seqs": resumed_seqs,
        "tokens_kept": sum(len(q) - len(prompts[0]) for q in resumed_seqs),
    }


async def baseline_prefill(engine, seqs, tag: str) -> float:
    """Raw AsyncLLM: submit the sequences to the idle engine; seconds until each has one
    new token."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
    )

    async def one(i, s):
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=s), sp, f"{tag}-{i}"):
            pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, s) for i, s in enumerate(seqs)))
    return time.perf_counter() - t0


async def main(args: argparse.Namespace) -> None:
    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.models import build_tiny_model
    from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig

    server = VLLMRolloutServer(
        VLLMServerConfig(
            model=str(build_tiny_model(size=args.size)),
            engine_kwargs={
                "max_model_len": 256,
                "dtype": "float32",
                "enforce_eager": True,
                "max_num_seqs": max(args.requests, 8),
                "disable_log_stats": True,
            },
        )
    )
    client = PartialRolloutClient(
        AsyncLoadBalancer({server.server_id: server}), PartialRolloutConfig(max_tokens=BUDGET)
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(32, 127) for _ in range(32)] for _ in range(args.requests)]
    rounds, base = [], []
    for r in range(args.repeats):
        rounds.append(await one_round(server, client, prompts, f"lat{r}"))
        base.append(await baseline_prefill(server.engine, rounds[-1]["seqs"], f"base{r}"))
    server.shutdown()

    med = statistics.median
    print()
    print(
        f"tiny random Qwen2 '{args.size}', vLLM-cpu float32, {os.cpu_count()} CPUs (shared; "
        f"load avg {os.getloadavg()[0]:.1f}); {args.requests} requests in flight, 32-token "
        f"prompts, aborted after >= 8 tokens each; median of {args.repeats} rounds (ms)"
    )
    rows = [
        ("abort_all() until every call returned 'aborted'", [x["abort"] for x in rounds]),
        ("resume()", [x["resume"] for x in rounds]),
        ("abort_all() -> all requests generating again", [x["to_generating"] for x in rounds]),
        ("baseline: raw re-prefill of the same sequences", base),
    ]
    for label, xs in rows:
        print(
            f"  {label:<50}{1e3 * med(xs):>9.1f}   runs: " + ", ".join(f"{1e3 * x:.0f}" for x in xs)
        )
    over = med(x["to_generating"] for x in rounds) - med(base)
    print(f"  offbeat overhead beyond the re-prefill: {1e3 * over:.1f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="tiny")
    asyncio.run(main(ap.parse_args()))
