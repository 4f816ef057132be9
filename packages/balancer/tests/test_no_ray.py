"""The core needs no Ray: it runs with `ray.init` patched to raise, and without Ray at all."""

import asyncio
import subprocess
import sys
import textwrap
import types

import pytest

from offbeat.balancer import LoadBalancer
from offbeat.balancer.actor import BalancerActor
from offbeat.balancer.aio import AsyncLoadBalancer


def test_core_runs_when_ray_init_raises(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the core must never start Ray")

    if "ray" in sys.modules:  # a real Ray another test imported: its init raises too
        monkeypatch.setattr(sys.modules["ray"], "init", boom)
    fake = types.ModuleType("ray")  # and any fresh `import ray` gets one that raises
    fake.init = boom
    fake.remote = boom
    monkeypatch.setitem(sys.modules, "ray", fake)
    lb = LoadBalancer(["a", "b"], policy="prefix")
    lb.release(lb.acquire("r", prompt_ids=list(range(32))))
    actor = BalancerActor(["a"])
    actor.release(actor.acquire("r"))

    async def go():
        alb = AsyncLoadBalancer(["a"])
        async with alb.lease("r") as lease:
            return lease.server_id

    assert asyncio.run(go()) == "a"


@pytest.mark.slow
def test_package_imports_and_runs_with_ray_missing():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["ray"] = None  # any `import ray` now fails
        from offbeat.balancer import LoadBalancer
        from offbeat.balancer.aio import AsyncLoadBalancer
        from offbeat.balancer.actor import BalancerActor, make_balancer_actor
        lb = LoadBalancer(["a"])
        assert lb.release(lb.acquire("r"))
        try:
            make_balancer_actor(["a"])
        except ImportError as e:
            assert "offbeat-balancer[ray]" in str(e), e
        else:
            raise SystemExit("make_balancer_actor worked without Ray")
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
