"""A replica scores given tokens (`compute_log_probs`, a distillation teacher's call) as
transformers does: log_softmax of the same model on the same tokens."""

from __future__ import annotations

import pytest
import torch

from offbeat.core.rollout import ScoringRolloutServer, supports_scoring

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]


def _hf_log_probs(model_dir, ids: list[int], start: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    return [float(lps[i - 1, ids[i]]) for i in range(start, len(ids))]


async def test_adapter_is_a_scoring_server(server):
    assert isinstance(server, ScoringRolloutServer)
    assert supports_scoring(server)


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
