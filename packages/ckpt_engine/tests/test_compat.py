"""offbeat.ckpt_engine.compat: the private torch.distributed names the broadcast backend
builds its own process group with are still there, and a group built that way (gloo, one
and two ranks over a store) broadcasts. An upgrade that moves a name fails here, by name."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from offbeat.ckpt_engine import compat


def test_the_plugin_registry_is_still_there():
    assert isinstance(dist.Backend._plugins, dict), "torch.distributed.Backend._plugins moved"


@pytest.mark.skipif(not hasattr(dist, "ProcessGroupNCCL"), reason="torch built without NCCL")
def test_nccl_options_still_take_a_timeout():
    opts = dist.ProcessGroupNCCL.Options()
    assert hasattr(opts, "_timeout"), "ProcessGroupNCCL.Options()._timeout moved"


def test_backend_names():
    assert compat.process_group_backend(torch.device("cpu")) == "gloo"
    assert compat.process_group_backend(torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="is not registered"):
        compat.new_process_group(dist.HashStore(), "k", "nosuch", 0, 1, 5)


def test_a_gloo_group_of_its_own_broadcasts():
    store = dist.HashStore()
    got: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        pg = compat.new_process_group(store, "t", "gloo", r, 2, 30)
        t = torch.arange(4.0) if r == 0 else torch.zeros(4)
        compat.broadcast(pg, t, 0).wait()
        got[r] = t

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert torch.equal(got[1], torch.arange(4.0))
    assert not dist.is_initialized()  # the default group was never touched
