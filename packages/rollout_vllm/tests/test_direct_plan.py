"""The direct-copy plan of the worker extension, against a model shaped as vLLM's are
(fused q/k/v and gate/up parameters with `output_sizes`, a vocab-padded embedding) whose
`load_weights` is written out here: the plan places each checkpoint name where that
`load_weights` puts it, and keeps a module direct only when what was loaded there is
bit for bit what was sent."""

from __future__ import annotations

import torch
from torch import nn

from offbeat.rollout_vllm.worker_extension import _DirectPlan, _fingerprint

H, Q, KV, FF, VOCAB, PADDED = 8, 8, 4, 12, 10, 16


class Fused(nn.Module):
    def __init__(self, sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.output_sizes = sizes
        self.weight = nn.Parameter(torch.zeros(sum(sizes), H), requires_grad=False)
        self.weight.output_dim = 0
        if bias:
            self.bias = nn.Parameter(torch.zeros(sum(sizes)), requires_grad=False)


class Model(nn.Module):
    def __init__(self, repack_mlp: bool = False) -> None:
        super().__init__()
        self.packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }
        self.embed = nn.Embedding(PADDED, H)
        self.embed.weight.requires_grad_(False).zero_()  # the padding rows stay 0
        self.qkv_proj = Fused([Q, KV, KV], bias=True)
        self.gate_up_proj = Fused([FF, FF], bias=False)
        self.norm = nn.LayerNorm(H, elementwise_affine=True, bias=False)
        self.norm.weight.requires_grad_(False)
        self.repack_mlp = repack_mlp

    def load_weights(self, named) -> None:
        """vLLM's semantics: shards into their slice of the fused parameter; the vocab into
        the first rows; with `repack_mlp` the MLP is stored transformed after loading (as a
        repacking platform does)."""
        offsets = {"q_proj": (0, Q), "k_proj": (Q, KV), "v_proj": (Q + KV, KV)}
        for name, t in named:
            module, _, leaf = name.rpartition(".")
            if module in offsets:
                off, n = offsets[module]
                getattr(self.qkv_proj, leaf).data[off : off + n].copy_(t)
            elif module in ("gate_proj", "up_proj"):
                off = 0 if module == "gate_proj" else FF
                w = t.flip(0) if self.repack_mlp else t
                self.gate_up_proj.weight.data[off : off + FF].copy_(w)
            elif not hasattr(self, module):
                continue  # a name this model does not load
            elif module == "embed":
                self.embed.weight.data[: t.shape[0]].copy_(t)
            else:
                getattr(self, module).weight.data.copy_(t)


def stream(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "embed.weight": (VOCAB, H), "q_proj.weight": (Q, H), "q_proj.bias": (Q,),
        "k_proj.weight": (KV, H), "k_proj.bias": (KV,), "v_proj.weight": (KV, H),
        "v_proj.bias": (KV,), "gate_proj.weight": (FF, H), "up_proj.weight": (FF, H),
        "norm.weight": (H,),
    }  # fmt: skip
    return [(n, torch.randn(s, generator=g)) for n, s in shapes.items()]


def first_sync(model: Model, named) -> _DirectPlan:
    plan = _DirectPlan(model)
    plan.observe(named)
    model.load_weights(named)
    plan.verify(model)
    return plan


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_plan_copies_each_name_where_load_weights_puts_it():
    model = Model()
    plan = first_sync(model, stream(0))
    assert plan.verified and plan.disabled is None and plan.all_direct
    assert set(plan.direct) == {n for n, _ in stream(0)}
    for name, t in stream(1):
        plan.direct[name].copy_(t)
    ref = Model()
    ref.load_weights(stream(1))
    for n, p in state(ref).items():
        assert torch.equal(state(model)[n], p), n


def test_a_module_loaded_other_than_by_copy_goes_wholly_through_load_weights():
    model = Model(repack_mlp=True)
    plan = first_sync(model, stream(0))
    assert plan.fallback == {"gate_proj.weight", "up_proj.weight"}
    assert "q_proj.weight" in plan.direct and not plan.all_direct


def test_the_whole_module_falls_back_when_one_of_its_names_cannot_be_placed():
    named = [(n, t.double() if n == "k_proj.bias" else t) for n, t in stream(0)]
    plan = first_sync(Model(), named)
    assert {n for n in plan.fallback} == {n for n, _ in stream(0) if n.split(".")[0] in ("q_proj", "k_proj", "v_proj")}  # fmt: skip


def test_a_name_the_model_does_not_have_disables_the_plan():
    plan = first_sync(Model(), [*stream(0)[:3], ("extra.weight", torch.ones(2))])
    assert plan.disabled and "extra.weight" in plan.disabled and not plan.all_direct


def test_fingerprint_tells_moved_bits_apart():
    t = torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(_fingerprint(t), _fingerprint(t.clone()))
    assert not torch.equal(_fingerprint(t), _fingerprint(t.flip(0)))
    u = t.clone()
    u.view(torch.int16)[3] ^= 1  # one bit
    assert not torch.equal(_fingerprint(t), _fingerprint(u))
