"""Hypothesis state machine over the replay buffer: whatever the interleaving of
submissions, completions, failures, training steps and checkpoint round trips, every
submitted prompt is trained exactly once, evicted, failed, or still in flight, and no
trained group ever has span above the threshold."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from offbeat.core.buffer import BufferConfig, GroupStatus, ReplayBuffer
from offbeat.core.data import Trajectory


class BufferMachine(RuleBasedStateMachine):
    @initialize(
        b=st.integers(1, 4),
        threshold=st.integers(1, 3),
        strategy=st.sampled_from(["drop", "wait"]),
        warmup=st.integers(0, 3),
    )
    def setup(self, b, threshold, strategy, warmup):
        if strategy == "drop":
            warmup = min(warmup, threshold - 1)
        self.b = b
        self.rb = ReplayBuffer(BufferConfig(b, threshold, strategy, warmup))
        self.submitted: set[str] = set()
        self.trained: list[str] = []
        self.evicted: set[str] = set()
        self.failed: set[str] = set()

    def _with(self, status):
        return sorted(uid for uid in self.rb.live_uids() if self.rb._groups[uid].status is status)

    @rule(n=st.integers(1, 8))
    def submit(self, n):
        n = min(n, self.rb.free_slots())
        if n:
            self.submitted |= {g.uid for g in self.rb.submit([{"n": i} for i in range(n)])}

    @rule(n=st.integers(1, 4))
    def take(self, n):
        self.rb.take_pending(n)

    @rule(data=st.data())
    def finish(self, data):
        running = self._with(GroupStatus.RUNNING)
        if running:
            uid = data.draw(st.sampled_from(running))
            version = self.rb.current_step - 1
            self.rb.finish(uid, [Trajectory([1], [2], [0.0], 1.0, version, version)])

    @rule(data=st.data())
    def fail(self, data):
        unfinished = self._with(GroupStatus.RUNNING) + self._with(GroupStatus.PENDING)
        if unfinished:
            uid = data.draw(st.sampled_from(unfinished))
            self.rb.fail(uid, "boom")
            self.failed.add(uid)

    @rule()
    def train_step(self):
        self.evicted |= {g.uid for g in self.rb.evict_stale()}
        if not self.rb.ready(self.b):
            return
        batch = self.rb.sample(self.b)
        threshold = self.rb.config.max_off_policy_threshold
        assert all(g.span(self.rb.current_step) <= threshold for g in batch)
        self.trained += [g.uid for g in batch]
        self.rb.begin_step(self.rb.current_step + 1)

    @precondition(lambda self: hasattr(self, "rb"))
    @rule()
    def checkpoint_round_trip(self):
        restored = ReplayBuffer(self.rb.config)
        restored.load_state_dict(self.rb.state_dict())
        assert restored.free_slots() == self.rb.free_slots()
        self.rb = restored

    @invariant()
    def accounting(self):
        if not hasattr(self, "rb"):
            return
        self.rb.check_accounting()
        assert len(self.trained) == len(set(self.trained)), "a group was trained twice"
        live = set(self.rb.live_uids())
        gone = set(self.trained) | self.evicted | self.failed
        assert not live & gone
        assert live | gone == self.submitted
        c = self.rb.counts()
        assert (c["trained"], c["evicted"], c["failed"]) == (
            len(self.trained),
            len(self.evicted),
            len(self.failed),
        )
        assert self.rb.free_slots() >= 0


TestBufferAccounting = BufferMachine.TestCase
TestBufferAccounting.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
