"""Rank 0 keeps one checkpoint-engine backend per slot (the rollout replicas' and the
hybrid replicas' managers), so two managers with different backends never share one."""

from __future__ import annotations

import threading

import pytest
import torch

from offbeat.ckpt_engine import receive
from offbeat.core.runtime import TrainerRank


class OneTensor:
    def export_weights(self):
        yield "model.w", torch.arange(4.0)


def open_kwargs(version: int) -> dict:
    return dict(version=version, num_receivers=1, bucket_bytes=1 << 20, checksum=False,
                timeout_s=10.0, members=("r",))  # fmt: skip


def test_each_slot_has_its_own_backend_and_sender():
    rank = TrainerRank(0, 1)
    rank.engine = OneTensor()
    (a,) = rank.open_sender("naive", {}, open_kwargs(1), "rollout")
    (b,) = rank.open_sender("shm", {}, open_kwargs(1), "hybrid")
    assert a.backend == "naive" and b.backend == "shm"
    assert rank._backends["rollout"] is not rank._backends["hybrid"]
    got = {}

    def load(pairs):
        got.update({n: t.clone() for n, t in pairs})

    receiver = threading.Thread(target=lambda: got.update(v=receive(b, load, 0)))
    receiver.start()
    rank.send_weights("hybrid")  # the hybrid slot's sender, not the rollout one
    receiver.join(10)
    assert got["v"] == 1 and torch.equal(got["model.w"], torch.arange(4.0))
    assert "rollout" in rank._senders and "hybrid" not in rank._senders
    with pytest.raises(RuntimeError, match="without an open sender \\(hybrid\\)"):
        rank.send_weights("hybrid")
    rank.abort_send("done", "rollout")
    rank.close_backend()
    assert rank._backends == {}


def test_a_drop_during_the_send_reaches_the_sender():
    """The manager drops a receiver whose health probe failed while rank 0 is sending (on
    another of the rank's threads): the send stops waiting for it and ends at once, not
    after the receiver's connect timeout."""
    import time

    rank = TrainerRank(0, 1)
    rank.engine = OneTensor()
    kwargs = {**open_kwargs(1), "timeout_s": 60.0}
    rank.open_sender("shm", {}, kwargs, "rollout")
    result = {}
    send = threading.Thread(target=lambda: result.update(r=rank.send_weights("rollout")))
    t0 = time.monotonic()
    send.start()  # receiver 0 never connects: its engine is dead
    time.sleep(0.3)
    rank.drop_receiver(0, "health check: EngineDeadError", "rollout")
    send.join(20)
    assert not send.is_alive() and time.monotonic() - t0 < 20
    assert result["r"].failed == {0: "health check: EngineDeadError"}
    assert "rollout" not in rank._senders  # the send is over: the slot's sender is gone
    rank.close_backend()
