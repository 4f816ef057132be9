"""Hypothesis state machine: LoadBalancer against a plain reference model.

Random acquire / release / add / remove / drain / unhealthy / healthy, for every policy.
Invariants: counts exact and never negative, no lease issued to a removed, draining or
unhealthy server, sticky sessions honoured, total in-flight equals the open leases' cost.
"""

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from offbeat.balancer import LoadBalancer, NoServerAvailable

IDS = [f"s{i}" for i in range(5)]
PROMPTS = [None, list(range(32)), list(range(48)), [7] * 40]


class _ModelServer:
    def __init__(self, inc):
        self.inc = inc
        self.count = 0
        self.healthy = True
        self.draining = False

    @property
    def accepting(self):
        return self.healthy and not self.draining


class BalancerMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["least_inflight", "round_robin", "power_of_two", "prefix"]),
        initial=st.lists(st.sampled_from(IDS), unique=True, max_size=4),
        seed=st.integers(0, 3),
        cap=st.sampled_from([None, None, 3, 5]),
    )
    def setup(self, policy, initial, seed, cap):
        self.policy = policy
        self.cap = cap
        self.lb = LoadBalancer(initial, policy=policy, seed=seed, max_inflight=cap)
        self.incs = 0
        self.model: dict[str, _ModelServer] = {}
        for sid in initial:
            self._model_add(sid)
        self.leases = []  # [lease, model incarnation, open?]
        self.sticky: dict[str, tuple[str, int]] = {}

    def _model_add(self, sid):
        if sid in self.model:
            self.model[sid].draining = False
        else:
            self.incs += 1
            self.model[sid] = _ModelServer(self.incs)

    # ---- rules ---------------------------------------------------------------------------
    @rule(sids=st.lists(st.sampled_from(IDS), unique=True, min_size=1, max_size=3))
    def add(self, sids):
        self.lb.add_servers(sids)
        for sid in sids:
            self._model_add(sid)

    @rule(
        sids=st.lists(st.sampled_from(IDS), unique=True, min_size=1, max_size=2),
        drain=st.booleans(),
    )
    def remove(self, sids, drain):
        expected = {s for s in sids if s in self.model}
        assert self.lb.remove_servers(sids, drain=drain) == expected
        for sid in expected:
            if drain and self.model[sid].count > 0:
                self.model[sid].draining = True
            else:
                del self.model[sid]

    @rule(sid=st.sampled_from(IDS), healthy=st.booleans())
    def health(self, sid, healthy):
        known = (self.lb.mark_healthy if healthy else self.lb.mark_unhealthy)(sid)
        assert known == (sid in self.model)
        if known:
            self.model[sid].healthy = healthy

    @rule(
        rid=st.sampled_from(["a", "b", "c", "d", "e", "f"]),
        cost=st.integers(1, 3),
        prompt=st.sampled_from(PROMPTS),
        group=st.sampled_from([None, "g1", "g2"]),
    )
    def acquire(self, rid, cost, prompt, group):
        accepting = [
            s
            for s, m in self.model.items()
            if m.accepting and (self.cap is None or m.count + cost <= self.cap)
        ]
        try:
            lease = self.lb.acquire(rid, group_id=group, prompt_ids=prompt, cost=cost)
        except NoServerAvailable:
            assert not accepting, f"refused although {accepting} have room"
            return
        sid = lease.server_id
        assert sid in accepting, f"lease to {sid} but accepting servers are {accepting}"
        m = self.model[sid]
        prev = self.sticky.get(rid)
        if prev is not None and prev[0] in self.model:
            pm = self.model[prev[0]]
            if pm.inc == prev[1] and prev[0] in accepting:
                assert sid == prev[0], "sticky session moved off a healthy active server"
        elif self.policy == "least_inflight":
            assert m.count == min(self.model[s].count for s in accepting)
        self.sticky[rid] = (sid, m.inc)
        m.count += cost
        self.leases.append([lease, m.inc, True])

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        entry = data.draw(st.sampled_from(self.leases))
        lease, inc, is_open = entry
        m = self.model.get(lease.server_id)
        expected = is_open and m is not None and m.inc == inc
        assert self.lb.release(lease) is expected
        entry[2] = False
        if expected:
            m.count -= lease.cost
            if m.draining and m.count == 0:
                del self.model[lease.server_id]

    @rule()
    def clear_sticky(self):
        self.lb.clear_sticky()
        self.sticky.clear()

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def counts_are_exact(self):
        status = self.lb.status()
        if self.cap is not None:
            assert all(c <= self.cap for c in status["servers"].values())
        assert status["servers"] == {s: m.count for s, m in self.model.items()}
        assert all(c >= 0 for c in status["servers"].values())
        open_cost = sum(
            lease.cost
            for lease, inc, is_open in self.leases
            if is_open and lease.server_id in self.model and self.model[lease.server_id].inc == inc
        )
        assert status["total_inflight"] == open_cost
        for sid in IDS:
            assert self.lb.inflight(sid) == (self.model[sid].count if sid in self.model else 0)

    @invariant()
    def membership_matches(self):
        assert self.lb.servers() == [s for s, m in self.model.items() if m.accepting]
        status = self.lb.status()
        assert status["draining"] == [s for s, m in self.model.items() if m.draining]
        assert status["unhealthy"] == [s for s, m in self.model.items() if not m.healthy]


BalancerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestBalancerMachine = BalancerMachine.TestCase
