"""The fused log-prob head against the plain computation (matmul, log_softmax, gather):
values and gradients, with temperature, entropy and several eager chunks; and installed
on a HF model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offbeat.core.train.logprob_head import (
    LogProbHead,
    linear_log_probs,
    supports_log_prob_head,
)


def plain(hidden, weight, targets, temperature, with_entropy):
    logits = (hidden @ weight.t()).float() / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
    return lp, ent


def inputs(n=37, h=16, v=50, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_rows", [5, 4096])  # several eager chunks, and one
def test_values_and_gradients_match_the_plain_path(with_entropy, temperature, chunk_rows):
    hidden, weight, targets = inputs()
    g = torch.Generator().manual_seed(1)
    w_lp = torch.randn(targets.shape, generator=g, dtype=hidden.dtype)
    w_ent = torch.randn(targets.shape, generator=g, dtype=hidden.dtype)

    def run(fn):
        hidden.grad = weight.grad = None
        lp, ent = fn(hidden, weight, targets, temperature, with_entropy)
        loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)
        loss.backward()
        return lp.detach(), (ent.detach() if ent is not None else None), hidden.grad, weight.grad

    def fused(*a):
        return linear_log_probs(*a, chunk_rows=chunk_rows)

    want, got = run(plain), run(fused)
    close(got[0], want[0])
    if with_entropy:
        close(got[1], want[1])
    else:
        assert got[1] is None
    close(got[2], want[2])
    close(got[3], want[3])


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding, relative to the tensor's scale (both paths compute
    softmax statistics in float32)."""
    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=2e-5 * scale)


def test_entropy_unused_in_the_loss_contributes_no_gradient():
    hidden, weight, targets = inputs()
    lp, ent = linear_log_probs(hidden, weight, targets, with_entropy=True, chunk_rows=8)
    assert ent is not None
    lp.sum().backward()
    got = hidden.grad.clone()
    hidden.grad = None
    want, _ = plain(hidden, weight, targets, 1.0, False)
    want.sum().backward()
    torch.testing.assert_close(got, hidden.grad, rtol=1e-5, atol=1e-5)


def test_output_is_float32_and_keeps_the_leading_shape():
    hidden, weight, targets = inputs(dtype=torch.bfloat16)
    lp, _ = linear_log_probs(hidden.view(1, 37, 16), weight, targets.view(1, 37))
    assert lp.dtype == torch.float32 and lp.shape == (1, 37)
    want, _ = plain(hidden, weight, targets, 1.0, False)
    torch.testing.assert_close(lp.view(-1), want, rtol=1e-5, atol=1e-5)


def tiny_qwen2(tied: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return Qwen2ForCausalLM(config).float()


@pytest.mark.parametrize("tied", [False, True])
def test_installed_head_returns_log_probs_inside_a_request_and_logits_outside(tied):
    model = tiny_qwen2(tied)
    names = [n for n, _ in model.named_parameters()]
    ids = torch.randint(0, 64, (3, 9))
    width = 5
    logits = model(input_ids=ids).logits
    ref = torch.log_softmax(logits[:, -width - 1 : -1].float() / 0.8, -1)
    ref = ref.gather(-1, ids[:, -width:, None]).squeeze(-1)

    head = LogProbHead.install(model, chunk_rows=4)
    assert [n for n, _ in model.named_parameters()] == names
    with head.request(ids[:, -width:], 0.8, with_entropy=True):
        out = model(input_ids=ids, logits_to_keep=width + 1).logits
    assert out.shape == (3, width, 2)
    torch.testing.assert_close(out[..., 0], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(input_ids=ids).logits, logits)  # request closed

    out[..., 0].sum().backward()
    assert model.lm_head.weight.grad is not None
    assert model.model.embed_tokens.weight.grad is not None


def test_head_refuses_too_few_positions():
    model = tiny_qwen2()
    head = LogProbHead.install(model)
    ids = torch.randint(0, 64, (2, 8))
    with head.request(ids[:, -4:], 1.0, False), pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, logits_to_keep=4)


def test_models_whose_forward_changes_the_logits_are_not_supported():
    model = tiny_qwen2()
    assert supports_log_prob_head(model)
    model.config.final_logit_softcapping = 30.0
    assert not supports_log_prob_head(model)
    with pytest.raises(ValueError, match="no plain LM head"):
        LogProbHead.install(model)
    other = tiny_qwen2()
    other.lm_head = nn.Linear(32, 64, bias=True)
    assert not supports_log_prob_head(other)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("with_entropy", [False, True])
def test_compiled_kernels_match_eager_chunks_on_cuda(with_entropy):
    """bf16 on a GPU: the compiled one-pass kernels give what the eager chunks give."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 300, 64, 1000
    hidden = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    outs = []
    for compiled in (False, True):
        hidden.grad = weight.grad = None
        lp, ent = linear_log_probs(
            hidden, weight, targets, 0.7, with_entropy, compiled=compiled, chunk_rows=64
        )
        loss = lp.sum() + (ent.sum() if ent is not None else 0.0)
        loss.backward()
        outs.append((lp.detach(), hidden.grad.float(), weight.grad.float()))
    for got, want in zip(outs[1], outs[0], strict=True):  # bf16 gradients: a few ulps
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * scale)
