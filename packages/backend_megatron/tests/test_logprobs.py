"""Log-probs and entropy from (vocabulary-parallel) logits: values and gradients equal the
plain log_softmax path, in chunks of rows, with padded vocabulary rows ignored."""

from __future__ import annotations

import pytest
import torch

from offbeat.backend_megatron import _logprobs
from offbeat.backend_megatron._logprobs import vocab_parallel_log_probs


@pytest.mark.parametrize("chunk", [3, 2048])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_log_probs_entropy_and_gradients_equal_the_plain_path(monkeypatch, chunk, temperature):
    monkeypatch.setattr(_logprobs, "CHUNK_ROWS", chunk)
    g = torch.Generator().manual_seed(0)
    vocab, padded = 37, 40  # three padding columns the real vocabulary never reaches
    logits = torch.randn(10, padded, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (10,), generator=g)
    w_lp, w_ent = (
        torch.randn(10, generator=g, dtype=torch.float64),
        torch.randn(10, generator=g, dtype=torch.float64),
    )

    mine = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(
        mine, targets, temperature, vocab_size=vocab, with_entropy=True
    )
    (lp * w_lp + ent * w_ent).sum().backward()

    ref = logits.clone().requires_grad_(True)
    log_p = torch.log_softmax(ref[:, :vocab] / temperature, dim=-1)
    ref_lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()

    torch.testing.assert_close(lp, ref_lp.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent.float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.grad, ref.grad, atol=1e-5, rtol=0)
    assert torch.equal(mine.grad[:, vocab:], torch.zeros(10, padded - vocab, dtype=torch.float64))


def test_without_entropy_there_is_none():
    lp, ent = vocab_parallel_log_probs(
        torch.randn(4, 8), torch.tensor([0, 1, 2, 7]), 1.0, vocab_size=8
    )
    assert ent is None and lp.shape == (4,) and bool((lp <= 0).all())
