"""The manager's lifecycle order, per-phase timings, elastic pools and group reuse."""

from __future__ import annotations

import itertools

import pytest
from ckpt_engine_fakes import BUCKET, RecordingTarget

from offbeat.ckpt_engine import PHASES, CheckpointEngineManager


async def test_lifecycle_order_across_replicas(model, make_target, calls):
    targets = {n: make_target(n) for n in ("r0", "r1", "r2")}
    mgr = CheckpointEngineManager("shm", bucket_bytes=BUCKET, phase_timeout_s=10)
    res = await mgr.sync(model.items(), 1, targets)
    assert res.ok and res.succeeded == ["r0", "r1", "r2"]
    for name in targets:
        assert [p for n, p in calls if n == name] == list(PHASES)
    # Phases are barriers: every replica finishes one phase before any starts the next.
    order = [PHASES.index(p) for _, p in calls]
    assert order == sorted(order)
    assert set(res.phase_s) == set(PHASES) and all(v >= 0 for v in res.phase_s.values())
    assert res.bytes >= sum(t.numel() * t.element_size() for t in model.values())
    assert res.transfer_gbps > 0


async def test_release_kv_false_skips_the_kv_phases_and_still_syncs(model, make_target, calls):
    targets = {n: make_target(n) for n in ("r0", "r1")}
    mgr = CheckpointEngineManager("shm", bucket_bytes=BUCKET, phase_timeout_s=10, release_kv=False)
    res = await mgr.sync(model.items(), 1, targets)
    assert res.ok and res.succeeded == ["r0", "r1"]
    kept = [p for p in PHASES if p not in ("release_kv", "resume_kv")]
    for name in targets:
        assert [p for n, p in calls if n == name] == kept
        assert targets[name].weight_version == 1
    assert set(res.phase_s) == set(kept)


async def test_phase_spans_per_pool_and_per_replica_are_ordered(model, make_target):
    targets = {"r0": make_target("r0"), "r1": make_target("r1", fail_in="release_kv")}
    mgr = CheckpointEngineManager("shm", bucket_bytes=BUCKET, phase_timeout_s=10)
    res = await mgr.sync(model.items(), 1, targets)
    assert list(res.phase_spans) == list(PHASES)
    windows = [res.phase_spans[p] for p in PHASES]
    assert all(s <= e for s, e in windows)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(windows))
    for name, spans in res.replica_spans.items():
        for phase, s, e in spans:  # each call lies inside its phase's pool-wide window
            lo, hi = res.phase_spans[phase]
            assert lo <= s <= e <= hi, (name, phase)
    assert [p for p, _, _ in res.replica_spans["r0"]] == list(PHASES)
    # r1 failed in release_kv: it takes part in no later phase
    assert [p for p, _, _ in res.replica_spans["r1"]] == ["abort", "release_kv"]


async def test_add_and_remove_replicas_between_syncs(model, make_target, calls):
    a, b = make_target("a"), make_target("b")
    mgr = CheckpointEngineManager("shm", bucket_bytes=BUCKET, phase_timeout_s=10)
    mgr.add_target("a", a)
    assert (await mgr.sync(model.items(), 1)).succeeded == ["a"]
    mgr.add_target("b", b)
    assert (await mgr.sync(model.items(), 2)).succeeded == ["a", "b"]
    assert mgr.remove_target("a") is a
    calls.clear()
    assert (await mgr.sync(model.items(), 3)).succeeded == ["b"]
    assert {n for n, _ in calls} == {"b"}
    assert (a.weight_version, b.weight_version) == (2, 3)
    with pytest.raises(ValueError, match="already registered"):
        mgr.add_target("b", b)
    with pytest.raises(KeyError, match="no replica named 'zz'"):
        mgr.remove_target("zz")
    with pytest.raises(TypeError, match="does not implement SyncTarget"):
        mgr.add_target("x", object())


async def test_broadcast_group_reused_while_membership_unchanged(model, make_target, monkeypatch):
    from offbeat.ckpt_engine import compat

    built = []
    real = compat.new_process_group

    def counting(store, key, backend, rank, world, timeout_s):
        built.append((key, rank, world))
        return real(store, key, backend, rank, world, timeout_s)

    monkeypatch.setattr(compat, "new_process_group", counting)
    a, b, c = make_target("a"), make_target("b"), make_target("c")
    mgr = CheckpointEngineManager("broadcast", bucket_bytes=BUCKET, phase_timeout_s=20)
    try:
        for v in (1, 2):
            assert (await mgr.sync(model.items(), v, {"a": a, "b": b})).succeeded == ["a", "b"]
        assert len(built) == 3  # sender + 2 receivers, once for both syncs
        assert sorted(r for _, r, _ in built) == [0, 1, 2]
        res = await mgr.sync(model.items(), 3, {"a": a, "b": b, "c": c})
        assert res.succeeded == ["a", "b", "c"]
        assert len(built) == 7 and {w for _, _, w in built[3:]} == {4}  # a fresh group of 4
        assert len({k for k, _, _ in built}) == 2
    finally:
        mgr.close()


async def test_broadcast_several_senders(make_target):
    """Two trainer ranks each stream their shard; receivers get the union."""
    import asyncio

    import torch

    from offbeat.ckpt_engine import get_backend
    from offbeat.ckpt_engine.broadcast import send_shard

    shard0 = {"a": torch.arange(700, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    shard1 = {"c": torch.arange(2000, dtype=torch.int32).reshape(40, 50), "d": torch.zeros(1)}
    backend = get_backend("broadcast")(num_senders=2)
    sender = backend.open_sender(
        version=1, num_receivers=2, bucket_bytes=BUCKET, checksum=True, timeout_s=20
    )
    r0, r1 = make_target("r0"), make_target("r1")
    other = asyncio.to_thread(send_shard, sender.spec(0).channel, 1, shard1.items(), 20)
    report, other_report, v0, v1 = await asyncio.gather(
        asyncio.to_thread(sender.send, shard0.items()),
        other,
        r0.update_weights(sender.spec(0)),
        r1.update_weights(sender.spec(1)),
    )
    assert report.failed == {} and (v0, v1) == (1, 1)
    assert other_report.bytes > 0
    for r in (r0, r1):
        assert set(r.sink.weights) == {"a", "b", "c", "d"}
        for name, t in {**shard0, **shard1}.items():
            assert torch.equal(r.sink.weights[name], t)


class ProxyTarget(RecordingTarget):
    """A remote replica's proxy: `weight_version` is what it last saw, None before that
    (reading it never asks the replica)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.seen: int | None = None

    @property
    def weight_version(self) -> int | None:
        return self.seen

    async def update_weights(self, spec):
        self.seen = await super().update_weights(spec)
        return self.seen


async def test_a_target_that_knows_no_version_yet_is_synced(model, calls):
    fresh, ahead = ProxyTarget("fresh", calls), ProxyTarget("ahead", calls, version=5)
    mgr = CheckpointEngineManager("shm", bucket_bytes=BUCKET, phase_timeout_s=10)
    res = await mgr.sync(model.items(), 3, {"fresh": fresh, "ahead": ahead})
    assert res.succeeded == ["fresh"] and fresh.weight_version == 3
    # Not caught before the transfer (its version was unknown): the receiver refuses it.
    assert "StaleVersionError" in res.failed["ahead"] and ahead.weight_version is None


async def test_a_sender_opened_elsewhere_is_awaited(model, make_target):
    """A backend whose sender lives in another process returns an awaitable from
    `open_sender` (offbeat-core's trainer group opens it on trainer rank 0)."""
    from offbeat.ckpt_engine.shm import ShmBackend

    class Remote(ShmBackend):
        opened = 0

        def open_sender(self, **kwargs):
            async def elsewhere():
                Remote.opened += 1
                return ShmBackend.open_sender(self, **kwargs)

            return elsewhere()

    target = make_target("r0")
    mgr = CheckpointEngineManager(Remote(), bucket_bytes=BUCKET, phase_timeout_s=10)
    try:
        res = await mgr.sync(model.items(), 1, {"r0": target})
    finally:
        mgr.close()
    assert res.ok and Remote.opened == 1 and target.weight_version == 1
