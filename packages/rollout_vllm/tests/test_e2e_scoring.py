"""A replica scores given tokens (`compute_log_probs`, a distillation teacher's call) as
transformers does: log_softmax of the same model on the same tokens."""

from __future__ import annotations

import pytest
import torch

from offbeat.core.rollout import (
    ScoringRolloutServer,
    TopKScoringRolloutServer,
    supports_scoring,
    supports_top_scoring,
)

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]


def _hf_log_softmax(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


def _hf_log_probs(model_dir, ids: list[int], start: int) -> list[float]:
    lps = _hf_log_softmax(model_dir, ids)
    return [float(lps[i - 1, ids[i]]) for i in range(start, len(ids))]


async def test_adapter_is_a_scoring_server(server):
    assert isinstance(server, ScoringRolloutServer)
    assert supports_scoring(server)
    assert isinstance(server, TopKScoringRolloutServer)
    assert supports_top_scoring(server)


async def test_teacher_top_k_equals_transformers_top_k(server, tiny_model, prompt_ids):
    # The top-k forward-KL loss reads the teacher's k most likely tokens at each position.
    out = await server.generate("resp-top", prompt_ids[2], {"max_tokens": 10, "seed": 3})
    ids = [*prompt_ids[2], *out.token_ids]
    start, k = len(prompt_ids[2]), 5
    got = await server.compute_top_log_probs("top-0", ids, start, k)
    assert len(got["log_probs"]) == len(got["top_ids"]) == len(got["top_log_probs"])
    assert len(got["top_ids"]) == len(out.token_ids)
    ref = _hf_log_softmax(tiny_model, ids)
    assert got["log_probs"] == pytest.approx(_hf_log_probs(tiny_model, ids, start), abs=1e-3)
    for j, i in enumerate(range(start, len(ids))):
        want_lp = ref[i - 1].topk(k).values
        assert len(got["top_ids"][j]) == k
        # Most likely first, the same log-probs; ids equal up to ties within 1e-3.
        assert got["top_log_probs"][j] == pytest.approx(want_lp.tolist(), abs=1e-3)
        assert got["top_log_probs"][j] == sorted(got["top_log_probs"][j], reverse=True)
        for t, lp in zip(got["top_ids"][j], got["top_log_probs"][j], strict=True):
            assert float(ref[i - 1, t]) == pytest.approx(lp, abs=1e-3)
    with pytest.raises(ValueError, match="k=0"):
        await server.compute_top_log_probs("top-bad", ids, start, 0)


async def test_teacher_log_probs_equal_transformers_log_softmax(server, tiny_model, prompt_ids):
    # A prompt plus a sampled response, scored from the response's first token on.
    out = await server.generate("resp", prompt_ids[1], {"max_tokens": 12, "seed": 1})
    ids = [*prompt_ids[1], *out.token_ids]
    start = len(prompt_ids[1])
    got = await server.compute_log_probs("score-0", ids, start)
    assert len(got) == len(out.token_ids)
    assert got == pytest.approx(_hf_log_probs(tiny_model, ids, start), abs=1e-3)
    # Scoring the whole sequence (every token after the first) agrees as well.
    for i, p in enumerate(prompt_ids):
        whole = await server.compute_log_probs(f"score-{i + 1}", p, 1)
        assert whole == pytest.approx(_hf_log_probs(tiny_model, p, 1), abs=1e-3)


async def test_scores_ignore_the_sampling_temperature_of_generation(server, prompt_ids):
    # Two identical requests give identical scores (no sampling noise enters them), and a
    # rescored sequence is not affected by requests in between.
    ids = prompt_ids[0]
    a = await server.compute_log_probs("t-a", ids, 1)
    await server.generate("between", prompt_ids[2], {"max_tokens": 8, "temperature": 0.3})
    b = await server.compute_log_probs("t-b", ids, 1)
    assert a == b
    assert all(x <= 0.0 for x in a)


async def test_bad_start_is_rejected(server, prompt_ids):
    with pytest.raises(ValueError, match="start=0"):
        await server.compute_log_probs("bad", prompt_ids[0], 0)
    with pytest.raises(ValueError, match="start="):
        await server.compute_log_probs("bad", prompt_ids[0], len(prompt_ids[0]) + 1)
