"""A prefill-decode replica on one CUDA GPU with real vLLM (the project's GPU machine has
vLLM 0.24): one P engine and one D engine (`pd_servers`, the shared-storage connector
through /dev/shm) beside one plain engine, all three bf16 on the tiny random Qwen2 and
the same weights. Skipped without CUDA.

- the PD replica's greedy tokens equal the single engine's, request by request, and the D
  engine really loaded the P engine's KV (its prompt tokens came from the connector);
- sleep and wake reach both engines; outputs afterwards are the same;
- a weight sync by `cuda_ipc` reaches both engines of the PD replica and the single engine
  in one sync (four receivers): outputs still equal, and differ from the old weights';
- an abort in the middle of decoding under the partial-rollout client: every response
  resumes to its full budget and equals the single engine's uninterrupted one.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import pytest_asyncio
import torch

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.ckpt_engine import CheckpointEngineManager
from offbeat.core.models import build_tiny_model
from offbeat.core.rollout import PartialRolloutClient, PartialRolloutConfig

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(600),
]

GREEDY = {"temperature": 0.0, "ignore_eos": True}
N = 32  # greedy tokens per prompt
BUDGET = 160  # abort/resume budget
ENGINE_KWARGS = {
    "max_model_len": 512,
    "dtype": "bfloat16",
    "enforce_eager": True,
    "max_num_seqs": 32,
    "seed": 0,
    "gpu_memory_utilization": 0.15,
}
# Prompt lengths: short (no whole block: nothing to transfer), n % 16 == 1 (the case the
# stock example connector looks up under the wrong folder), and longer ones.
LENGTHS = [5, 17, 33, 40, 49, 97, 130, 200, 301]


@pytest.fixture(scope="module")
def w0(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("pw0") / "tiny", "tiny", seed=0, dtype="bfloat16"
    )


@pytest.fixture(scope="module")
def w1(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("pw1") / "tiny", "tiny", seed=1, dtype="bfloat16"
    )


@pytest.fixture(scope="module")
def prompts(w0):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(w0).vocab_size
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def single(w0):
    from offbeat.rollout_vllm import VLLMRolloutServer, VLLMServerConfig, compat

    print(f"\nvLLM {compat.VLLM_VERSION}")
    srv = VLLMRolloutServer(
        VLLMServerConfig(model=str(w0), engine_kwargs=dict(ENGINE_KWARGS), server_id="single")
    )
    yield srv
    srv.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pd(w0, tmp_path_factory):
    import shutil

    from offbeat.rollout_vllm.pd import pd_servers

    root = os.environ.get("OFFBEAT_PD_STORAGE", "/dev/shm")
    storage = os.path.join(root, f"offbeat-pd-test-{os.getpid()}")
    srv = pd_servers(str(w0), dict(ENGINE_KWARGS), storage, server_id="pd")
    yield srv
    srv.shutdown()
    shutil.rmtree(storage, ignore_errors=True)


async def one_by_one(server, prompts, tag: str, n: int = N):
    return [
        await server.generate(f"{tag}-{i}", p, {"max_tokens": n, **GREEDY})
        for i, p in enumerate(prompts)
    ]


def assert_same_greedy(outs, ref, what: str) -> None:
    diverged = []
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        if o.token_ids != r.token_ids:
            at = next(
                (
                    k
                    for k, (a, b) in enumerate(zip(o.token_ids, r.token_ids, strict=False))
                    if a != b
                ),
                min(len(o.token_ids), len(r.token_ids)),
            )
            diverged.append((i, len(ref[i].token_ids), at))
    pairs = [
        abs(a - b)
        for o, r in zip(outs, ref, strict=True)
        if o.token_ids == r.token_ids
        for a, b in zip(o.logprobs, r.logprobs, strict=True)
    ]
    print(f"{what}: {len(outs) - len(diverged)}/{len(outs)} identical, largest log-prob "
          f"gap {max(pairs, default=0.0):.2e}; diverged (prompt, length, first position): "
          f"{diverged}")  # fmt: skip
    assert not diverged, f"{what}: greedy outputs differ from the single engine's: {diverged}"


async def test_pd_greedy_equals_single_engine_and_kv_is_transferred(pd, single, prompts):
    ref = await one_by_one(single, prompts, "ref")
    before = dict(pd.stats)
    outs = await one_by_one(pd, prompts, "pd")
    assert_same_greedy(outs, ref, "PD vs single engine")
    assert all(len(o.token_ids) == N and o.stop_reason == "length" for o in outs)
    assert all(o.extra["server_id"] == "pd" and o.extra["engine_id"] == "pd-d0" for o in outs)
    # Fresh prompts: the D engine's prompt tokens came from the connector (its own prefix
    # cache has never seen them); the short prompt's had nothing to transfer.
    for n, o in zip(LENGTHS, outs, strict=True):
        loaded = o.extra["num_cached_tokens"]
        expected = (n - 2) // 16 * 16 if n > 16 else 0
        print(f"prompt of {n} tokens: the D engine loaded {loaded}")
        assert loaded == expected, (n, loaded, expected)
    assert pd.stats["prefills"] - before["prefills"] == sum(n > 16 for n in LENGTHS)
    # The replica removed every prompt's KV after its request.
    await pd.storage_settled()
    assert os.listdir(pd.storage.path) == [], os.listdir(pd.storage.path)


async def test_pd_batched_equals_one_by_one(pd, prompts):
    """Concurrent requests of the same prompt share one prefill."""
    ref = await one_by_one(pd, prompts[:4], "pd1")
    before = pd.stats["prefills_shared"]
    outs = await asyncio.gather(
        *(pd.generate(f"pdb-{i}", prompts[3], {"max_tokens": N, **GREEDY}) for i in range(4))
    )
    assert pd.stats["prefills_shared"] - before == 3
    assert all(o.token_ids == ref[3].token_ids for o in outs)


async def test_pd_sleep_and_wake_reach_every_engine(pd, single, prompts):
    ref = await one_by_one(single, prompts, "ref-s")
    await pd.sleep(1)
    assert [e.asleep_level for e in pd.engines] == [1, 1]
    await pd.wake_up()
    await pd.resume()
    assert [e.asleep_level for e in pd.engines] == [0, 0]
    assert_same_greedy(await one_by_one(pd, prompts, "pd-s"), ref, "PD after sleep/wake")


def named_tensors(model_dir, device: str = "cuda"):
    from safetensors.torch import load_file

    return [
        (n, t.to(device))
        for n, t in sorted(load_file(str(model_dir / "model.safetensors")).items())
    ]


async def test_pd_weight_sync_reaches_every_engine(pd, single, w0, w1, prompts):
    old = await one_by_one(single, prompts, "old")
    manager = CheckpointEngineManager("cuda_ipc", bucket_bytes=1 << 20, phase_timeout_s=120)
    try:
        v = max(single.weight_version, pd.weight_version)
        result = await manager.sync(named_tensors(w1), v + 1, {"single": single, "pd": pd})
        assert result.ok, result.failed
        assert [e.weight_version for e in pd.engines] == [v + 1, v + 1]
        assert pd.weight_version == single.weight_version == v + 1
        ref = await one_by_one(single, prompts, "new")
        outs = await one_by_one(pd, prompts, "pd-new")
        assert_same_greedy(outs, ref, "PD vs single engine after a weight sync")
        assert all(o.weight_version == v + 1 for o in outs)
        assert [o.token_ids for o in ref] != [o.token_ids for o in old]
        # The D engine loaded KV the P engine computed at the new weights (the old
        # weights' were dropped by the sync, or the outputs would differ above).
        assert any(o.extra["num_cached_tokens"] > 0 for o in outs)
    finally:
        manager.close()


async def wait_until_decoding(engine, n: int, tokens: int) -> None:
    from offbeat.rollout_vllm.compat import tokens_received

    for _ in range(4000):
        got = sorted(tokens_received(engine.engine), reverse=True)
        if len(got) >= n and got[n - 1] >= tokens:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"requests did not start decoding: {tokens_received(engine.engine)}")


class Attempts:
    """The PD replica, recording each attempt the client makes: (request, prompt length,
    tokens it produced, stop reason)."""

    def __init__(self, pd) -> None:
        self.pd, self.server_id, self.log = pd, pd.server_id, []

    @property
    def weight_version(self):
        return self.pd.weight_version

    def __getattr__(self, name):
        return getattr(self.pd, name)

    async def generate(self, request_id, prompt_ids, sampling_params):
        out = await self.pd.generate(request_id, prompt_ids, sampling_params)
        self.log.append((request_id, len(prompt_ids), list(out.token_ids), out.stop_reason))
        return out


async def test_pd_abort_mid_decoding_then_resume_equals_single_engine(pd, single, prompts):
    """An abort lands while the D engine decodes; the client resends prompt + tokens so
    far, which the PD replica prefills (P) and decodes (D) as a new request. Each attempt
    equals the single engine's answer to the same request: the first attempt the first
    tokens of its uninterrupted answer, the resumed one its answer to prompt + those
    tokens. (Against the single engine's uninterrupted answer a resumed response may part
    at a near-tie: the resumed tokens' keys and values come from a prefill instead of
    decode steps, a bf16 difference that a single engine resuming shows alike; printed.)"""
    ref = await one_by_one(single, prompts, "ref-a", BUDGET)
    seen = Attempts(pd)
    client = PartialRolloutClient(
        AsyncLoadBalancer({"pd": seen}), PartialRolloutConfig(max_tokens=BUDGET)
    )
    tasks = [
        asyncio.create_task(client.generate(f"pa-{i}", p, GREEDY)) for i, p in enumerate(prompts)
    ]
    await wait_until_decoding(pd.decode[0], len(prompts), tokens=8)
    await pd.abort_all()
    assert all(e.is_paused for e in pd.engines)
    assert pd.decode[0].last_abort["inflight"] == len(prompts)
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in tasks)
    await pd.resume()
    outs = await asyncio.gather(*tasks)
    for out in outs:
        assert out.stop_reason == "length"
        assert len(out.token_ids) == len(out.logprobs) == BUDGET
        assert out.extra["num_attempts"] >= 2  # the abort landed mid-response
    by_request: dict[int, list] = {}
    for rid, _n, toks, stop in seen.log:
        by_request.setdefault(int(rid.split("-")[1]), []).append((toks, stop))
    resumed_ref = []
    for i, p in enumerate(prompts):
        (first, stop), *rest = by_request[i]
        assert stop == "aborted" and 0 < len(first) < BUDGET, (i, len(first), stop)
        assert first == ref[i].token_ids[: len(first)], f"prompt {i}: first attempt differs"
        assert len(rest) == 1 and rest[0][1] == "length"
        again = await single.generate(
            f"ra-{i}", p + first, {"max_tokens": BUDGET - len(first), **GREEDY}
        )
        resumed_ref.append((len(first), again))
        assert rest[0][0] == again.token_ids, f"prompt {i}: resumed attempt differs"
    print("abort points:", [k for k, _ in resumed_ref])
    # For the record: against the uninterrupted answers (PD's and the single engine's own
    # resumed answers alike).
    single_resumed = [
        ref[i].token_ids[:k] + again.token_ids for i, (k, again) in enumerate(resumed_ref)
    ]
    same_pd = sum(o.token_ids == r.token_ids for o, r in zip(outs, ref, strict=True))
    same_single = sum(s == r.token_ids for s, r in zip(single_resumed, ref, strict=True))
    print(
        f"equal to the uninterrupted answer: PD {same_pd}/{len(ref)}, the single engine "
        f"resumed at the same points {same_single}/{len(ref)}"
    )
    assert [o.token_ids for o in outs] == single_resumed
    await pd.storage_settled()
    assert os.listdir(pd.storage.path) == []
