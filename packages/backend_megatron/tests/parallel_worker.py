"""One rank of a multi-process Megatron engine run, started by
``python -m torch.distributed.run --nproc-per-node N parallel_worker.py MODEL OUT ...``.

Every rank builds the engine (TP × PP × DP = N), scores its data-parallel share of one
batch, runs one decoupled-PPO update (entropy bonus on) and exports its weights before and
after; rank 0 writes the union of all ranks' results to OUT/r.pt: HF-named weights before
and after the update, the batch's log-probs in row order, the update's metrics.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
import torch.distributed as dist


def _union(local: dict) -> dict:
    """Every rank's dict merged (PP stages export different layers; TP ranks the same)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out: dict = {}
    for part in parts:
        out.update(part)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    from engine_helpers import LOSSES, make_batch, megatron, params, rows_of, with_old_log_probs

    engine = megatron(
        Path(args.model_dir), loss=LOSSES["decoupled_entropy"], device=args.device,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
        param_dtype=args.dtype, micro_batch_size=3,
    )  # fmt: skip
    dp, dp_rank = engine.dp_size, engine.dp_rank
    full = make_batch(args.rows, seed=args.seed)
    mine = rows_of(full, dp_rank * args.rows // dp, (dp_rank + 1) * args.rows // dp)
    before = _union(params(engine))
    log_probs = _union({dp_rank: engine.compute_log_probs(mine)})
    metrics = engine.update(with_old_log_probs(engine, mine))
    after = _union(params(engine))
    if dist.get_rank() == 0:
        torch.save(
            {
                "before": before,
                "after": after,
                "log_probs": torch.cat([log_probs[r] for r in range(dp)]),
                "metrics": metrics,
                "world": dist.get_world_size(),
                "optimizer": engine.optimizer_kind,
            },
            os.path.join(args.out, "r.pt"),
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
