"""PartialRolloutClient.generate_group against a scripted group server: one lease and one
request per group, then per-sample resumes after an abort.

Sample `k` of a group request is seeded `seed + k` (vLLM's rule), and a sample's tokens
are a function of its seed and its whole sequence so far, so a resumed sample must equal
its uninterrupted reference exactly: a lost, duplicated or misrouted token (another
sample's, or a wrong seed) changes every token after it.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.core.rollout import (
    GroupRolloutServer,
    PartialRolloutClient,
    PartialRolloutConfig,
    TokenOutput,
    sample_params,
    supports_group,
)

PROMPT = [5, 9, 2]
SEED = 100
EOS = 0


def token_after(seq: list[int], seed: int, eos: dict[int, int]) -> int:
    """The next token of the sample seeded `seed`; EOS at response position eos[seed]."""
    n = len(seq) - len(PROMPT)
    if eos.get(seed) == n:
        return EOS
    if n == 0:
        return 1000 + seed
    return (31 * seq[-1] + 7 * len(seq)) % 997 + 1


def reference(seed: int, budget: int, eos: dict[int, int] | None = None) -> list[int]:
    seq, out = list(PROMPT), []
    while len(out) < budget:
        tok = token_after(seq, seed, eos or {})
        out.append(tok)
        seq.append(tok)
        if tok == EOS:
            break
    return out


class GroupServer:
    """Call c (group or single) follows `script[c]`: {sample k of that call: tokens it
    produces before answering "aborted"}; samples not named run to EOS or max_tokens. A
    call that aborted anything is followed by a weight sync (the version advances).
    `produced[seed]`: the version of every token returned for that sample;
    `attempts[seed]`: the version of every attempt that included it."""

    def __init__(self, script=(), eos: dict[int, int] | None = None) -> None:
        self.script = list(script)
        self.eos = eos or {}
        self.version = 0
        self.calls: list[dict] = []
        self.produced: dict[int, list[int]] = defaultdict(list)
        self.attempts: dict[int, list[int]] = defaultdict(list)

    @property
    def weight_version(self) -> int:
        return self.version

    def _start(self, kind, request_id, prompt_ids, params, n) -> tuple[dict, int]:
        assert "n" not in params and "max_new_tokens" not in params
        assert isinstance(params["max_tokens"], int) and params["max_tokens"] >= 1
        self.calls.append(
            {"kind": kind, "request_id": request_id, "prompt": list(prompt_ids),
             "params": dict(params), "n": n}
        )  # fmt: skip
        return (self.script.pop(0) if self.script else {}), self.version

    def _one(self, prompt, seed, max_tokens, abort_after, v) -> TokenOutput:
        seq, out, stop = list(prompt), [], "length"
        while len(out) < max_tokens:
            if abort_after is not None and len(out) >= abort_after:
                stop = "aborted"
                break
            tok = token_after(seq, seed, self.eos)
            out.append(tok)
            seq.append(tok)
            if tok == EOS:
                stop = "stop"
                break
        self.produced[seed] += [v] * len(out)
        self.attempts[seed].append(v)
        return TokenOutput(out, [-t / 1000 for t in out], stop, weight_version=v,
                           routed_experts=[[t, 1] for t in out])  # fmt: skip

    def _after(self, outs: list[TokenOutput]) -> None:
        if any(o.stop_reason == "aborted" for o in outs):
            self.version += 1

    async def generate(self, request_id, prompt_ids, params) -> TokenOutput:
        plan, v = self._start("single", request_id, prompt_ids, params, 1)
        await asyncio.sleep(0)
        out = self._one(prompt_ids, params.get("seed", 0), params["max_tokens"], plan.get(0), v)
        self._after([out])
        return out

    async def generate_group(self, request_id, prompt_ids, params, n) -> list[TokenOutput]:
        plan, v = self._start("group", request_id, prompt_ids, params, n)
        await asyncio.sleep(0)
        seed = params.get("seed", 0)
        outs = [
            self._one(prompt_ids, seed + k, params["max_tokens"], plan.get(k), v) for k in range(n)
        ]
        self._after(outs)
        return outs

    async def abort_all(self): ...
    async def resume(self): ...
    async def release_kv_cache(self): ...
    async def resume_kv_cache(self): ...
    async def sleep(self, level=1): ...
    async def wake_up(self, tags=None): ...


class SingleOnly:
    """The same engine behind a server without `generate_group` (the fallback path)."""

    def __init__(self, inner: GroupServer) -> None:
        self.inner = inner

    async def generate(self, request_id, prompt_ids, params):
        return await self.inner.generate(request_id, prompt_ids, params)


class RecordingBalancer(AsyncLoadBalancer):
    def __init__(self, servers) -> None:
        super().__init__(servers)
        self.acquired: list[dict] = []

    async def acquire(self, request_id, **kw):
        lease = await super().acquire(request_id, **kw)
        self.acquired.append({"key": request_id, "cost": kw.get("cost", 1),
                              "server": lease.server_id})  # fmt: skip
        return lease


def check_sample(out: TokenOutput, server: GroupServer, seed: int, budget: int) -> None:
    """Tokens, alignment, stop reason and weight-version bounds of one finished sample."""
    ref = reference(seed, budget, server.eos)
    assert out.token_ids == ref
    assert out.logprobs == [-t / 1000 for t in ref]
    assert out.routed_experts == [[t, 1] for t in ref]
    assert out.stop_reason == ("stop" if ref[-1:] == [EOS] else "length")
    kept = server.produced[seed]
    assert len(kept) == len(ref)  # nothing returned was dropped or produced twice
    if kept:
        assert (out.min_weight_version, out.max_weight_version) == (min(kept), max(kept))
    else:
        last = server.attempts[seed][-1]
        assert out.min_weight_version == out.max_weight_version == last


def check_calls(server: GroupServer, budget: int) -> None:
    """Every call asked for exactly a sample's remaining budget, never more."""
    for c in server.calls:
        generated = len(c["prompt"]) - len(PROMPT)
        assert c["params"]["max_tokens"] == budget - generated >= 1
        if c["kind"] == "group":
            assert generated == 0 and c["n"] > 1  # a group call only for fresh samples


def test_the_protocol_is_optional():
    server = GroupServer()
    assert isinstance(server, GroupRolloutServer) and supports_group(server)
    assert not supports_group(SingleOnly(server))
    assert sample_params({"seed": 7, "top_p": 0.5}, 3) == {"seed": 10, "top_p": 0.5}
    assert sample_params({"seed": None}, 3) == {"seed": None}


async def test_abort_mid_group_each_sample_resumes_alone():
    """Sample 0 stopped (EOS), 1 reached its budget, 2 was cut after 4 tokens, 3 before
    its first: 0 and 1 stay finished, 2 and 3 resume as their own single requests."""
    server = GroupServer(script=[{2: 4, 3: 0}], eos={SEED: 3})
    balancer = RecordingBalancer({"s0": server})
    client = PartialRolloutClient(balancer)
    params = MappingProxyType({"max_tokens": 10, "temperature": 1.0, "seed": SEED})
    outs = await client.generate_group("g", PROMPT, params, 4)

    assert dict(params) == {"max_tokens": 10, "temperature": 1.0, "seed": SEED}
    assert [o.stop_reason for o in outs] == ["stop", "length", "length", "length"]
    for i, out in enumerate(outs):
        check_sample(out, server, SEED + i, 10)
    check_calls(server, 10)
    group, *singles = server.calls
    assert (group["kind"], group["n"], group["request_id"]) == ("group", 4, "g")
    assert group["params"]["seed"] == SEED
    assert [(c["kind"], c["request_id"], c["params"]["seed"]) for c in singles] == [
        ("single", "g-2", SEED + 2),
        ("single", "g-3", SEED + 3),
    ]
    assert singles[0]["prompt"] == PROMPT + outs[2].token_ids[:4]
    assert singles[1]["prompt"] == PROMPT
    assert [o.extra["num_attempts"] for o in outs] == [1, 1, 2, 2]
    # 2 kept tokens from before and after the sync; 3's aborted attempt bounds nothing.
    assert (outs[2].min_weight_version, outs[2].max_weight_version) == (0, 1)
    assert (outs[3].min_weight_version, outs[3].max_weight_version) == (1, 1)
    assert (outs[0].max_weight_version, outs[1].max_weight_version) == (0, 0)
    # One lease for the group (cost 4); the resumes lease under the group's id (sticky).
    assert balancer.acquired[0] == {"key": "g", "cost": 4, "server": "s0"}
    assert [a["key"] for a in balancer.acquired[1:]] == ["g", "g"]
    assert balancer.inflight("s0") == 0


@pytest.mark.parametrize(
    ("script", "seed", "second"),
    [
        ([{0: 0, 1: 0, 2: 0, 3: 0}], SEED, ("group", 4, SEED)),  # all queued in a sync
        ([{1: 0, 2: 0, 3: 0}], SEED, ("group", 3, SEED + 1)),  # 0 done, 1-3 contiguous
        ([{1: 0, 3: 0}], None, ("group", 2, None)),  # unseeded: any samples may share
        ([{1: 0, 3: 0}], SEED, ("single", 1, SEED + 1)),  # seeded, not contiguous
    ],
)
async def test_samples_without_tokens_go_again_as_one_group(script, seed, second):
    server = GroupServer(script=script)
    client = PartialRolloutClient(AsyncLoadBalancer({"s0": server}))
    params = {"max_tokens": 6} if seed is None else {"max_tokens": 6, "seed": seed}
    outs = await client.generate_group("g", PROMPT, params, 4)
    assert len(outs) == 4 and all(len(o.token_ids) == 6 for o in outs)
    call = server.calls[1]
    assert (call["kind"], call["n"], call["params"].get("seed")) == second
    if seed is not None:
        for i, out in enumerate(outs):
            check_sample(out, server, seed + i, 6)
    check_calls(server, 6)


async def test_a_server_without_generate_group_gets_n_requests_under_one_lease():
    # Sample 2's request (the third call) is aborted after 3 tokens.
    inner = {sid: GroupServer(script=[{}, {}, {0: 3}]) for sid in "ab"}
    balancer = RecordingBalancer({sid: SingleOnly(s) for sid, s in inner.items()})
    client = PartialRolloutClient(balancer)
    outs = await client.generate_group("g", PROMPT, {"max_tokens": 8, "seed": SEED}, 4)

    used = balancer.acquired[0]["server"]
    server = inner[used]
    for i, out in enumerate(outs):
        check_sample(out, server, SEED + i, 8)
    check_calls(server, 8)
    first = server.calls[:4]
    assert [(c["kind"], c["request_id"], c["params"]["seed"]) for c in first] == [
        ("single", f"g-{i}", SEED + i) for i in range(4)
    ]
    assert server.calls[4]["request_id"] == "g-2"  # the resume
    assert server.calls[4]["prompt"] == PROMPT + outs[2].token_ids[:3]
    # One lease of cost 4 for the group; the resume sticks to the group's server.
    assert balancer.acquired[0]["cost"] == 4
    assert {a["server"] for a in balancer.acquired} == {used}
    assert inner["b" if used == "a" else "a"].calls == []


async def test_ray_style_group_handle_is_called_through_remote():
    class RemoteMethod:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            return asyncio.ensure_future(self.fn(*args))

    class ActorHandle:
        def __init__(self, server):
            self.generate = RemoteMethod(server.generate)
            self.generate_group = RemoteMethod(server.generate_group)

    server = GroupServer(script=[{0: 2}])
    client = PartialRolloutClient(AsyncLoadBalancer({"actor": ActorHandle(server)}))
    outs = await client.generate_group("g", PROMPT, {"max_tokens": 5, "seed": SEED}, 3)
    for i, out in enumerate(outs):
        check_sample(out, server, SEED + i, 5)
    assert [c["kind"] for c in server.calls] == ["group", "single"]


async def test_max_attempts_bounds_each_sample():
    server = GroupServer(script=[{1: 1}, {0: 1}, {0: 1}])
    client = PartialRolloutClient(AsyncLoadBalancer({"s": server}), PartialRolloutConfig(
        max_attempts=3))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"'g-1'.*max_attempts=3"):
        await client.generate_group("g", PROMPT, {"max_tokens": 5, "seed": SEED}, 2)


async def test_bad_group_arguments_are_refused_before_any_call():
    server = GroupServer()
    client = PartialRolloutClient(AsyncLoadBalancer({"s": server}))
    with pytest.raises(ValueError, match="n=0"):
        await client.generate_group("g", PROMPT, {"max_tokens": 4}, 0)
    with pytest.raises(ValueError, match="sampling_params n=4"):
        await client.generate_group("g", PROMPT, {"max_tokens": 4, "n": 4}, 4)
    with pytest.raises(ValueError, match="max_tokens=0"):
        await client.generate_group("g", PROMPT, {"max_tokens": 0}, 2)
    assert server.calls == []


async def test_a_server_returning_the_wrong_number_of_samples_fails_loudly():
    class Short(GroupServer):
        async def generate_group(self, request_id, prompt_ids, params, n):
            return (await super().generate_group(request_id, prompt_ids, params, n))[:-1]

    balancer = AsyncLoadBalancer({"s": Short()})
    with pytest.raises(RuntimeError, match=r"n=3\) returned 2 outputs"):
        await PartialRolloutClient(balancer).generate_group("g", PROMPT, {"max_tokens": 4}, 3)
    assert balancer.inflight("s") == 0


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 5),
    budget=st.integers(1, 8),
    script=st.lists(st.dictionaries(st.integers(0, 4), st.integers(0, 8), max_size=5), max_size=6),
    eos=st.dictionaries(st.integers(0, 4), st.integers(0, 8), max_size=3),
    group=st.booleans(),
)
def test_any_abort_pattern_keeps_every_sample_exact(n, budget, script, eos, group):
    """Whatever the server aborts when (group or single calls, before or after the first
    token, several syncs), each sample equals its uninterrupted reference, no call asks
    for more than that sample has left, and the version bounds are those of its tokens."""
    server = GroupServer(script=script, eos={SEED + k: v for k, v in eos.items()})
    handle = server if group else SingleOnly(server)
    client = PartialRolloutClient(AsyncLoadBalancer({"s": handle}))
    outs = asyncio.run(client.generate_group("g", PROMPT, {"max_tokens": budget, "seed": SEED}, n))
    assert len(outs) == n
    for i, out in enumerate(outs):
        check_sample(out, server, SEED + i, budget)
        assert out.weight_version <= server.version
    check_calls(server, budget)
