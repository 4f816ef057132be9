"""copy_into: the fused loader for plain models, alone and at the end of shm syncs that
reuse the receiver's per-bucket views from one sync to the next."""

from __future__ import annotations

import asyncio

import pytest
import torch
from ckpt_engine_fakes import BUCKET, digest

from offbeat.ckpt_engine import CheckpointEngineManager, copy_into, receive
from offbeat.ckpt_engine.bucket import copy_many


def _params() -> dict[str, torch.Tensor]:
    return {
        "a": torch.zeros(3, 5, dtype=torch.bfloat16),
        "b": torch.zeros(7, dtype=torch.float32, requires_grad=True),
        "c": torch.zeros(1, dtype=torch.int64),
    }


def test_copy_into_copies_bit_exact():
    params = _params()
    src = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.randn(7),
        "c": torch.tensor([-5]),
    }
    copy_into(params)(list(src.items()))
    for name, t in src.items():
        assert digest(params[name].detach()) == digest(t), name
    assert params["b"].requires_grad  # loaded through .data, the parameter is unchanged


@pytest.mark.parametrize(
    ("pairs", "error", "words"),
    [
        ([("zz", torch.zeros(1))], KeyError, ["'zz'"]),
        ([("a", torch.zeros(5, 3, dtype=torch.bfloat16))], ValueError, ["'a'", "(5, 3)", "(3, 5)"]),
        ([("c", torch.zeros(1, dtype=torch.int32))], ValueError, ["torch.int32", "torch.int64"]),
    ],
)
def test_copy_into_names_what_does_not_fit(pairs, error, words):
    params = _params()
    with pytest.raises(error) as e:
        copy_into(params)([("a", torch.ones(3, 5, dtype=torch.bfloat16)), *pairs])
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not params["a"].any()  # nothing of that call was copied


def test_copy_many_mixed_lists():
    dsts = [torch.zeros(4), torch.zeros(2, dtype=torch.float64), torch.zeros(0)]
    srcs = [torch.arange(4.0), torch.tensor([1.5, 2.5], dtype=torch.float64), torch.zeros(0)]
    copy_many(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


class _ModelTarget:
    """A receiver with a pre-allocated model loaded by copy_into."""

    def __init__(self, like: dict[str, torch.Tensor]) -> None:
        self.params = {n: torch.zeros_like(t) for n, t in like.items()}
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    async def abort_all(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, spec) -> int:
        self._version = await asyncio.to_thread(
            receive, spec, copy_into(self.params), self._version
        )
        return self._version


async def test_shm_syncs_of_changing_weights_into_copy_into(model):
    """The same layout sync after sync (the receiver reuses its views of each bucket): every
    sync must deliver that sync's values, not the previous ones."""
    target = _ModelTarget(model)
    mgr = CheckpointEngineManager("shm", bucket_bytes=BUCKET, phase_timeout_s=30, checksum=True)
    try:
        for version in (1, 2, 3):
            sent = {n: ~t if t.dtype == torch.bool else t + version for n, t in model.items()}
            res = await mgr.sync(sent.items(), version, {"m": target})
            assert res.failed == {}, res.failed
            assert target.weight_version == version
            for name, t in sent.items():
                assert digest(target.params[name]) == digest(t), (version, name)
    finally:
        mgr.close()
