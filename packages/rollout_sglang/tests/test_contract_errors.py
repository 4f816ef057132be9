"""Bad answers from the server (a 5xx, a 4xx on a control call, a body that is not JSON, no
answer in time) become errors that name the endpoint and the status, and the replica pool
takes the replica out of the balancer."""

from __future__ import annotations

import pytest

from offbeat.balancer.aio import AsyncLoadBalancer
from offbeat.core.trainer.replicas import ReplicaPool
from offbeat.rollout_sglang import SGLangHTTPError, SGLangRolloutServer, SGLangServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


async def _removed_from_balancer(server, error: BaseException) -> str:
    balancer = AsyncLoadBalancer({server.server_id: server})
    pool = ReplicaPool({server.server_id: server}, balancer, manager=None)
    assert await pool.on_engine_error(error) is False  # nothing left to retry on
    assert balancer.servers() == []
    return pool.removed[server.server_id]


async def test_a_5xx_on_generate(server, control):
    await control.script(fail={"generate": {"status": 503, "message": "scheduler died"}})
    with pytest.raises(SGLangHTTPError) as e:
        await server.generate("r", [1], {"max_tokens": 2})
    assert (e.value.endpoint, e.value.status) == ("/generate", 503)
    assert "scheduler died" in str(e.value)
    why = await _removed_from_balancer(server, e.value)
    assert "/generate" in why and "503" in why


async def test_a_malformed_body(server, control):
    await control.script(malformed={"/generate": 1})
    with pytest.raises(SGLangHTTPError, match=r"SGLang /generate: HTTP 200: malformed body"):
        await server.generate("r", [1], {"max_tokens": 2})
    assert len(await control.calls("generate")) == 1  # SGLang did run it
    why = await _removed_from_balancer(server, RuntimeError("x"))
    assert "malformed body" in why


async def test_a_timeout(sglang_app, control):
    srv = SGLangRolloutServer(
        SGLangServerConfig(model="m", url=sglang_app.url, generate_timeout_s=0.5)
    )
    try:
        await control.script(hang_s=30)
        with pytest.raises(
            SGLangHTTPError, match=r"SGLang /generate: no response: no answer within 0.5s"
        ):
            await srv.generate("r", [1], {"max_tokens": 2})
        why = await _removed_from_balancer(srv, RuntimeError("x"))
        assert "no answer within" in why
    finally:
        await srv.aclose()


async def test_a_control_call_refused(server, control):
    await control.script(fail={"release_memory_occupation": {"times": 1}})
    with pytest.raises(SGLangHTTPError) as e:
        await server.release_kv_cache()
    assert (e.value.endpoint, e.value.status) == ("/release_memory_occupation", 400)
    assert "injected failure in release_memory_occupation" in str(e.value)
    await _removed_from_balancer(server, e.value)


async def test_an_unhealthy_server(server, control):
    assert await server.refresh() == 0
    await control.script(gracefully_exit=True)  # SGLang's /health answers 503 then
    why = await _removed_from_balancer(server, RuntimeError("x"))
    assert "/health" in why and "503" in why
