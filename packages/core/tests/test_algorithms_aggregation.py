"""Loss aggregation: every mode, the policy and the value loss, give the same gradient
summed over any micro-batch split (and over data-parallel shards) as on the full
mini-batch, and that full-batch value matches each mode's textbook definition."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from offbeat.core.algorithms import (
    AGG_MODES,
    LossNormalizer,
    agg_loss,
    decoupled_ppo_loss,
    global_normalizer,
    value_loss,
)
from offbeat.core.registry import LOSS_AGG_MODES

HORIZON = 9.0  # the "max response tokens" constant of seq-mean-token-sum-norm


def make_data(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(max(lengths), 1)
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).double()

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = rnd(b, t)
    return {
        "x": x,
        "mask": mask,
        "old": -F.softplus(x * 0.5) + 0.4 * rnd(b, t),  # proximal: ratios on both sides of the clip
        "behav": -F.softplus(x * 0.5) + 0.4 * rnd(b, t),
        "adv": rnd(b, t) * 2,
        "old_values": rnd(b, t),
        "returns": rnd(b, t),
    }


def model(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny differentiable 'model': per-token log-probs and values from features."""
    return -F.softplus(x * w[0] + w[1]), x * w[2] + w[3]


def micro_loss(kind: str, mode: str, w: torch.Tensor, d: dict, norm: LossNormalizer):
    log_probs, values = model(w, d["x"])
    if kind == "policy":
        out = decoupled_ppo_loss(
            log_probs, d["old"], d["behav"], d["adv"], d["mask"], norm,
            mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
            is_level="token", is_mode="truncate", is_threshold=2.0,
        )  # fmt: skip
    else:
        out = value_loss(
            values, d["old_values"], d["returns"], d["mask"], norm, cliprange_value=0.2, mode=mode
        )
    return out.loss


def rows(d: dict, lo: int, hi: int, trim: bool = True) -> dict:
    """Rows lo:hi, with the columns cut to the part's own longest row (as a micro-batch
    re-padded on its own would be)."""
    part = {k: v[lo:hi] for k, v in d.items()}
    if trim:
        width = max(int(part["mask"].sum(-1).max()), 1)
        part = {k: v[:, :width] for k, v in part.items()}
    return part


def grad_of(kind: str, mode: str, parts: list[dict], norm: LossNormalizer) -> torch.Tensor:
    w = torch.tensor([0.7, -0.3, 0.5, 0.1], dtype=torch.float64, requires_grad=True)
    for part in parts:  # gradient accumulation: one backward per micro-batch
        micro_loss(kind, mode, w, part, norm).backward()
    return w.grad.clone()


def cut(n: int, sizes: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for s in sizes:
        if start >= n:
            break
        out.append((start, min(start + s, n)))
        start += s
    if start < n:
        out.append((start, n))
    return out


batches = st.lists(st.integers(0, 8), min_size=1, max_size=9)
splits = st.lists(st.integers(1, 4), min_size=1, max_size=9)


@pytest.mark.parametrize("kind", ["policy", "value"])
@pytest.mark.parametrize("mode", AGG_MODES)
@settings(max_examples=25, deadline=None)
@given(lengths=batches, sizes=splits, seed=st.integers(0, 2**16))
def test_micro_batch_gradients_sum_to_full_gradient(kind, mode, lengths, sizes, seed):
    d = make_data(lengths, seed)
    full_norm = global_normalizer(d["mask"], horizon=HORIZON)
    full = grad_of(kind, mode, [d], full_norm)

    parts = [rows(d, lo, hi) for lo, hi in cut(len(lengths), sizes)]
    norm = global_normalizer([p["mask"] for p in parts], horizon=HORIZON)
    assert norm == full_norm
    torch.testing.assert_close(grad_of(kind, mode, parts, norm), full, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["policy", "value"])
@pytest.mark.parametrize("mode", AGG_MODES)
@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(0, 8), min_size=2, max_size=9), data=st.data())
def test_two_data_parallel_ranks_average_to_full_gradient(kind, mode, lengths, data):
    """Each rank normalises by counts over BOTH shards and scales by the world size; the
    DP wrapper averages the two gradients: the result is the full mini-batch gradient."""
    d = make_data(lengths, data.draw(st.integers(0, 2**16)))
    full = grad_of(kind, mode, [d], global_normalizer(d["mask"], horizon=HORIZON))

    split = data.draw(st.integers(1, len(lengths) - 1))
    shards = [rows(d, 0, split, trim=False), rows(d, split, len(lengths), trim=False)]
    micro = data.draw(st.integers(1, 3))
    rank_parts = [[rows(s, lo, hi) for lo, hi in cut(len(s["x"]), [micro] * 9)] for s in shards]
    # what the all-reduce of global_normalizer computes from each rank's local counts
    local = [LossNormalizer.from_mask(s["mask"], horizon=HORIZON) for s in shards]
    summed = LossNormalizer.combine(local)
    norm = LossNormalizer(summed.num_tokens, summed.num_seqs, summed.horizon, loss_scale=2.0)
    averaged = sum(grad_of(kind, mode, parts, norm) for parts in rank_parts) / 2
    torch.testing.assert_close(averaged, full, rtol=1e-9, atol=1e-12)


def reference(token_loss: torch.Tensor, mask: torch.Tensor, mode: str, horizon: float) -> float:
    """Each mode's definition, written row by row."""
    seqs = [
        [float(v) for v, m in zip(row, mrow, strict=True) if m]
        for row, mrow in zip(token_loss, mask, strict=True)
    ]
    seqs = [s for s in seqs if s]
    tokens = [v for s in seqs for v in s]
    if not tokens:
        return 0.0
    if mode == "token-mean":
        return sum(tokens) / len(tokens)
    if mode == "token-sum":
        return sum(tokens)
    if mode == "seq-mean-token-sum":
        return sum(sum(s) for s in seqs) / len(seqs)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(s) / horizon for s in seqs) / len(seqs)
    return sum(sum(s) / len(s) for s in seqs) / len(seqs)  # seq-mean-token-mean


@pytest.mark.parametrize("mode", AGG_MODES)
@settings(max_examples=20, deadline=None)
@given(lengths=batches, seed=st.integers(0, 2**16))
def test_full_batch_value_matches_definition(mode, lengths, seed):
    d = make_data(lengths, seed)
    norm = global_normalizer(d["mask"], horizon=HORIZON)
    got = agg_loss(d["adv"], d["mask"], mode, norm)
    assert float(got) == pytest.approx(reference(d["adv"], d["mask"], mode, HORIZON), rel=1e-9)


def test_per_micro_batch_normalisation_would_differ():
    """The invariant above is not vacuous: normalising each micro-batch by its own token
    count (the shipped bug) changes the gradient when lengths differ."""
    d = make_data([1, 7], seed=0)
    full = grad_of("policy", "token-mean", [d], global_normalizer(d["mask"]))
    w = torch.tensor([0.7, -0.3, 0.5, 0.1], dtype=torch.float64, requires_grad=True)
    for lo in (0, 1):
        part = rows(d, lo, lo + 1)
        micro_loss("policy", "token-mean", w, part, global_normalizer(part["mask"])).backward()
    assert not torch.allclose(w.grad / 2, full)


def test_horizon_defaults_to_longest_row_not_padded_width():
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    n = LossNormalizer.from_mask(mask)
    assert (n.num_tokens, n.num_seqs, n.horizon) == (5.0, 2.0, 3.0)
    assert LossNormalizer.from_mask(torch.zeros(2, 3)).num_seqs == 0.0
    assert float(agg_loss(torch.ones(2, 3), torch.zeros(2, 3), "token-mean", n)) == 0.0


def test_unknown_mode_lists_registered_and_shape_mismatch():
    n = LossNormalizer(1.0, 1.0)
    with pytest.raises(KeyError, match=r"registered: .*seq-mean-token-mean"):
        agg_loss(torch.ones(1, 2), torch.ones(1, 2), "seq-mean", n)
    with pytest.raises(ValueError, match="loss"):
        agg_loss(torch.ones(1, 2), torch.ones(1, 3), "token-mean", n)
    assert set(AGG_MODES) <= set(LOSS_AGG_MODES.names())


_RANK_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from offbeat.core.algorithms import global_normalizer
rank, init, lengths = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
mask = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).long()
n = global_normalizer(mask, loss_scale=2.0)
print(json.dumps([n.num_tokens, n.num_seqs, n.horizon, n.loss_scale]))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_global_normalizer_all_reduces_over_a_real_gloo_group(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    shards = [[2, 0, 5], [1, 6]]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT, str(r), init, json.dumps(shards[r])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    # tokens 2+5+1+6 = 14, non-empty rows 4, longest 6: the same on both ranks
    assert [json.loads(o.strip().splitlines()[-1]) for o, _ in outs] == [[14.0, 4.0, 6.0, 2.0]] * 2
