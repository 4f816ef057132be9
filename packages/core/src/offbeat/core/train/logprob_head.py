"""Token log-probs (and entropy) straight from a causal LM's last hidden states and its
LM-head weight, without the float32 copies of the [tokens, vocab] logits.

The plain path (`logits / T`, `.float()`, `log_softmax`, `gather`) writes and keeps several
[tokens, vocab] tensors, two of them in float32: at a 152k vocabulary and 16k tokens that
is ~10 GB each, and the passes over them cost more than the LM head's matmul. Here the
logits are made once in the compute dtype by one matmul and kept for backward; one fused
pass (compiled on GPU, chunks of rows in eager) turns them into the log-sum-exp, the
target's log-prob and the entropy in float32 registers; backward makes the logits'
gradient in one more pass and runs the two matmuls autograd would. Same FLOPs, a fraction
of the memory traffic.

`LogProbHead.install(model)` makes a HF causal LM's `lm_head` return log-probs while a
request is open (parameter names, tying and sharding unchanged). Knows nothing about FSDP,
losses or masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LogProbHead", "linear_log_probs", "supports_log_prob_head"]

# Model types whose forward returns lm_head's output untouched (no logit soft-capping or
# scaling after the head), so the head may return log-probs in place of logits.
_PLAIN_HEAD_MODEL_TYPES = frozenset(
    {"qwen2", "qwen3", "llama", "mistral", "qwen2_moe", "qwen3_moe"}
)

# Rows per eager pass: bounds the float32 temporaries to rows x vocab x 4 bytes.
DEFAULT_CHUNK_ROWS = 2048


def _stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-sum-exp, target log-prob, entropy or None) per row of `logits / temperature`,
    in float32."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    log_prob = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        p = torch.exp(z - lse.unsqueeze(-1))
        entropy = lse - (p * z).sum(dim=-1)
    return lse, log_prob, entropy


def _grad_logits(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    g_log_prob: torch.Tensor,
    g_entropy: torch.Tensor | None,
    entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """dL/dlogits in the logits' dtype. With z = logits / T and p = softmax(z):
    d log_prob / dz = onehot(target) - p, d entropy / dz = -p (log p + entropy)."""
    z = logits.float() / temperature
    log_p = z - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    cols = torch.arange(z.shape[-1], device=z.device)
    onehot = (cols.unsqueeze(0) == targets.unsqueeze(-1)).to(z.dtype)
    gz = g_log_prob.float().unsqueeze(-1) * (onehot - p)
    if g_entropy is not None and entropy is not None:
        gz = gz - g_entropy.float().unsqueeze(-1) * p * (log_p + entropy.unsqueeze(-1))
    return (gz / temperature).to(logits.dtype)


class _Kernels:
    """The two per-row passes, eager or compiled (compiled only where inductor has a
    backend worth it: a GPU)."""

    def __init__(self, compiled: bool) -> None:
        self.compiled = compiled
        if compiled:
            self.stats: Callable[..., Any] = torch.compile(_stats, dynamic=True)
            self.grad: Callable[..., Any] = torch.compile(_grad_logits, dynamic=True)
        else:
            self.stats, self.grad = _stats, _grad_logits


_KERNELS: dict[bool, _Kernels] = {}


def _kernels(compiled: bool) -> _Kernels:
    """One set per process, so each compiled pass is compiled once."""
    if compiled not in _KERNELS:
        _KERNELS[compiled] = _Kernels(compiled)
    return _KERNELS[compiled]


def _row_chunks(n: int, chunk_rows: int, whole: bool) -> list[tuple[int, int]]:
    """Row ranges of the eager passes; one range for compiled kernels, which read the
    whole tensor in one pass without float32 copies."""
    step = n if whole else max(1, chunk_rows)
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        kernels: _Kernels,
        chunk_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = hidden @ weight.t()  # [N, V], compute dtype: the only copy
        chunks = _row_chunks(logits.shape[0], chunk_rows, kernels.compiled)
        parts = [
            kernels.stats(logits[a:b], targets[a:b], temperature, with_entropy) for a, b in chunks
        ]
        lse = _join([p[0] for p in parts])
        log_prob = _join([p[1] for p in parts])
        entropy = _join([p[2] for p in parts]) if with_entropy else lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, targets, logits, lse, entropy)
        ctx.temperature, ctx.with_entropy = temperature, with_entropy
        ctx.kernels, ctx.chunks = kernels, chunks
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx: Any, g_log_prob: torch.Tensor, g_entropy: torch.Tensor | None):  # type: ignore[override]
        hidden, weight, targets, logits, lse, entropy = ctx.saved_tensors
        if g_log_prob is None:
            g_log_prob = torch.zeros_like(lse)
        with_entropy = ctx.with_entropy and g_entropy is not None
        grad = _join(
            [
                ctx.kernels.grad(
                    logits[a:b],
                    lse[a:b],
                    targets[a:b],
                    g_log_prob[a:b],
                    g_entropy[a:b] if with_entropy else None,
                    entropy[a:b] if with_entropy else None,
                    ctx.temperature,
                )
                for a, b in ctx.chunks
            ]
        )
        del logits
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    *,
    compiled: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T / temperature)[targets] in float32 (and the entropy
    of that softmax), for hidden [..., H], weight [V, H], targets [...] int64; differentiable
    in hidden and weight. Equals the plain computation up to float rounding."""
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    kernels = _kernels(compiled)
    log_prob, entropy = _LinearLogProbs.apply(
        h, weight, targets.reshape(-1), float(temperature), with_entropy, kernels, chunk_rows
    )
    return log_prob.view(lead), (entropy.view(lead) if with_entropy else None)


def supports_log_prob_head(model: nn.Module) -> bool:
    """Whether `install` applies: a plain Linear LM head without bias, on a model type whose
    forward returns the head's output as the logits."""
    config = getattr(model, "config", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return (
        getattr(config, "model_type", None) in _PLAIN_HEAD_MODEL_TYPES
        and getattr(config, "final_logit_softcapping", None) is None
        and type(head) is nn.Linear
        and head.bias is None
    )


class LogProbHead:
    """While `request(targets, temperature, with_entropy)` is open, the model's `lm_head`
    returns, instead of logits, a float32 [B, W, 1 or 2] tensor: the log-prob of
    `targets` [B, W] at the positions that predict them (the W positions before the last
    one it is given) and, with entropy, the entropy there. Outside a request it is the
    plain head."""

    def __init__(self, head: nn.Linear, compiled: bool, chunk_rows: int) -> None:
        self._head = head
        self._kernels = _kernels(compiled)
        self._chunk_rows = chunk_rows
        self._request: tuple[torch.Tensor, float, bool] | None = None

    @classmethod
    def install(
        cls, model: nn.Module, *, compiled: bool = False, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> LogProbHead:
        if not supports_log_prob_head(model):
            raise ValueError(
                f"{type(model).__name__} has no plain LM head to fuse (model_type "
                f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}; supported: "
                f"{sorted(_PLAIN_HEAD_MODEL_TYPES)} with a bias-free nn.Linear lm_head)"
            )
        head = model.get_output_embeddings()
        self = cls(head, compiled, chunk_rows)
        head.forward = self._forward  # an instance attribute: names and hooks unchanged
        return self

    @contextlib.contextmanager
    def request(
        self, targets: torch.Tensor, temperature: float, with_entropy: bool
    ) -> Iterator[None]:
        self._request = (targets, float(temperature), bool(with_entropy))
        try:
            yield
        finally:
            self._request = None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self._head.weight
        if self._request is None:
            return F.linear(hidden, weight)
        targets, temperature, with_entropy = self._request
        width = targets.shape[1]
        if hidden.shape[1] < width + 1:
            raise ValueError(
                f"the LM head got {hidden.shape[1]} positions; predicting {width} targets "
                f"needs {width + 1} (pass logits_to_keep >= {width + 1})"
            )
        h = hidden[:, -(width + 1) : -1, :]
        log_prob, entropy = _LinearLogProbs.apply(
            h.reshape(-1, h.shape[-1]),
            weight,
            targets.reshape(-1),
            temperature,
            with_entropy,
            self._kernels,
            self._chunk_rows,
        )
        parts = [log_prob.view(targets.shape)]
        if with_entropy:
            parts.append(entropy.view(targets.shape))
        return torch.stack(parts, dim=-1)
