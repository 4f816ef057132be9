"""The replay buffer's Ray actor shell: the same rules behind `make_buffer_actor`."""

from __future__ import annotations

import pytest

from offbeat.core.buffer import BufferConfig, make_buffer_actor
from offbeat.core.data import Trajectory

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ray_local(ray_session):
    return ray_session.up()  # local, loopback, the driver's interpreter


def test_actor_round_trip_and_accounting(ray_local):
    ray = ray_local
    actor = make_buffer_actor(BufferConfig(2, 2, "drop", 0))
    groups = ray.get(actor.submit.remote([{"q": 1}, {"q": 2}]))
    assert [g.uid for g in groups] == ["g0", "g1"]
    taken = ray.get(actor.take_pending.remote(2))
    for g in taken:
        t = Trajectory([1], [2], [-0.1], 1.0, 0, 0, group_uid=g.uid)
        ray.get(actor.finish.remote(g.uid, [t]))
    batch, evicted = ray.get(actor.sample.remote(2, 10.0))
    assert [g.uid for g in batch] == ["g0", "g1"] and evicted == []
    assert ray.get(actor.counts.remote())["trained"] == 2
    ray.get(actor.check_accounting.remote())
    state = ray.get(actor.state_dict.remote())
    assert state["ledger"] == {"g0": "trained", "g1": "trained"}
