"""The one engine contract: every registered rollout-engine factory is started exactly as the
job starts it, through the job's own functions: the rollout pool's replicas
(`elastic.start_replicas`), hybrid replicas in the trainer pool (`elastic.start_hybrid_replicas`,
awaited until they answer and put to sleep) and a replacement for a dead replica
(`elastic.replacement_for`). Each factory takes a `ReplicaSpec` and starts core's shared
replica actor; `ray.remote` is recorded, not run, so what each factory hands to Ray is
checked: the actor class, the build path, the replica's cores, name, bundle and log file.
(`rollout.engine=sglang` once stopped at its first replica with a TypeError.)"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from offbeat.core.cli import load_recipe_config
from offbeat.core.registry import ROLLOUT_ENGINES
from offbeat.core.rollout.remote import RemoteRolloutServer, ReplicaActor

ENGINES = ["vllm", "sglang"]


def test_every_registered_engine_is_covered():
    assert sorted(ROLLOUT_ENGINES.names()) == sorted(ENGINES)


class FakePools:
    """The rollout and trainer pools of ResourcePools, as far as the factories' callers read
    them."""

    def __init__(self) -> None:
        from offbeat.core.runtime.pools import PoolSpec

        self.groups = {"rollout": object(), "trainer": object()}
        self.specs = {
            "rollout": PoolSpec("rollout", 2, {"CPU": 1.0}),
            "trainer": PoolSpec("trainer", 1, {"CPU": 2.0}),
        }

    def strategy(self, pool: str, index: int) -> str:
        return f"{pool}-bundle-{index}"

    def bundle_order(self, pool: str) -> list[int]:
        return [0, 1]


class _Method:
    def __init__(self, handle: FakeHandle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, *args):
        self.handle.calls.append(self.name)

        async def answer():
            return 0 if self.name == "get_weight_version" else None

        return answer()


class FakeHandle:
    """An actor handle that answers every call at once (`handle.m.remote(...)`)."""

    def __init__(self, start: dict) -> None:
        self.start = start
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


def recorded(monkeypatch) -> list[dict]:
    """What reaches `ray.remote(**options)(cls).remote(*args)`, one dict per actor."""
    import ray

    starts: list[dict] = []

    def remote(**options):
        def wrap(cls):
            def start(build, config, cpus):
                starts.append({"cls": cls, "build": build, "config": config, "cpus": cpus,
                               **options})  # fmt: skip
                return FakeHandle(starts[-1])

            return SimpleNamespace(remote=start)

        return wrap

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "kill", lambda handle: handle.calls.append("ray.kill"))
    return starts


# The recipe's engine_kwargs are vLLM's: validation refuses them with rollout.engine=sglang.
ENGINE_ARGS = {
    "vllm": [],
    "sglang": [f"rollout.engine_kwargs.{k}=null" for k in ("max_model_len", "enforce_eager",
                                                           "max_num_seqs", "seed")],
}  # fmt: skip


def job(engine: str, **over):
    _, cfg = load_recipe_config(
        "separate_async",
        [f"rollout.engine={engine}", "resources.devices_per_node=3",
         "resources.rollout_devices=2", "runtime.trainer_cpus=[]",
         "runtime.rollout_cpus=[0,1]", *ENGINE_ARGS[engine]],
    )  # fmt: skip
    # the trainer's cores, set past validation (it checks them against this machine's)
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, trainer_cpus=[4, 5]))
    if over:
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **over))
    return cfg


def prepared(cfg):
    return SimpleNamespace(cfg=cfg, model_dir=Path("/m"))


def server_id(start: dict) -> str:
    config = start["config"]
    return config["server_id"] if isinstance(config, dict) else config.server_id


@pytest.mark.parametrize("engine", ENGINES)
async def test_every_engine_factory_starts_as_the_job_starts_it(monkeypatch, engine):
    from offbeat.core.trainer.elastic import replacement_for, start_hybrid_replicas, start_replicas

    starts = recorded(monkeypatch)
    cfg, pools = job(engine), FakePools()
    servers = start_replicas(prepared(cfg), pools)
    hybrid = await start_hybrid_replicas(prepared(cfg), pools)
    replacement = replacement_for(prepared(cfg), pools, servers)
    new = await replacement.start("rollout-1", "rollout-1-r1", servers["rollout-1"])

    assert list(servers) == ["rollout-0", "rollout-1"] and list(hybrid) == ["hybrid-0"]
    every = [*servers.values(), *hybrid.values(), new]
    assert all(isinstance(s, RemoteRolloutServer) for s in every)
    # one shell for every engine, the engine's server built inside it
    assert {s["cls"] for s in starts} == {ReplicaActor}
    assert len({s["build"] for s in starts}) == 1
    assert [server_id(s) for s in starts] == ["rollout-0", "rollout-1", "hybrid-0", "rollout-1-r1"]
    assert [s["scheduling_strategy"] for s in starts] == [
        "rollout-bundle-0",
        "rollout-bundle-1",
        "trainer-bundle-0",
        "rollout-bundle-1",
    ]
    # each replica's share of runtime.rollout_cpus; the hybrid one its rank's cores
    assert [s["cpus"] for s in starts] == [[0], [1], [4, 5], [1]]
    assert starts[2]["num_gpus"] == 0 and starts[0]["num_cpus"] == cfg.runtime.rollout_num_cpus
    # the hybrid replica answered, then slept; the dead replica's actor was killed first
    assert hybrid["hybrid-0"].handle.calls == ["get_weight_version", "sleep"]
    assert servers["rollout-1"].handle.calls == ["ray.kill"]
    assert new.handle.calls == ["get_weight_version"] and new.weight_version == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_every_engine_factory_sends_its_replica_to_a_file_of_its_own(monkeypatch, engine):
    """Each replica's process writes to <log_dir>/<experiment_name>/logs/<server_id>.log
    (offbeat.core.process_log); with trainer.verbose it stays where Ray forwards it."""
    from offbeat.core.process_log import LOG_ENV, RAY_SETUP_HOOK_ENV, replica_log_path
    from offbeat.core.rollout.replica_spec import ReplicaSpec, start_replica
    from offbeat.core.runtime.launch import replica_options

    starts = recorded(monkeypatch)
    cfg = job(engine)
    start_replica(ReplicaSpec(cfg, "/m", 0, ray_options=replica_options(FakePools(), 0)))
    start_replica(ReplicaSpec(cfg, "/m", 0, server_id="hybrid-0", cpus=[1]))
    envs = [s.get("runtime_env", {}).get("env_vars", {}) for s in starts]
    want = [replica_log_path(cfg, "rollout-0"), replica_log_path(cfg, "hybrid-0")]
    assert [e.get(LOG_ENV) for e in envs] == [str(p) for p in want]
    assert want[1].name == "hybrid-0.log" and want[1].parent.name == "logs"
    assert all(RAY_SETUP_HOOK_ENV in e for e in envs)
    starts.clear()
    start_replica(ReplicaSpec(job(engine, verbose=True), "/m", 0))
    env = starts[0].get("runtime_env", {}).get("env_vars", {})
    assert LOG_ENV not in env and RAY_SETUP_HOOK_ENV not in env


@pytest.mark.parametrize("engine", ENGINES)
def test_starting_replicas_imports_no_engine(engine):
    """The driver starts replicas without importing the engine: the shell builds the server
    inside the actor (vLLM's import alone is seconds of CPU)."""
    code = (
        "import sys, ray\n"
        "from types import SimpleNamespace as N\n"
        "ray.remote = lambda **o: (lambda cls: N(remote=lambda *a: N()))\n"
        "from offbeat.core.cli import load_recipe_config\n"
        "from offbeat.core.rollout.replica_spec import ReplicaSpec, start_replica\n"
        f"_, cfg = load_recipe_config('separate_async', {['rollout.engine=' + engine, *ENGINE_ARGS[engine]]!r})\n"
        "start_replica(ReplicaSpec(cfg, '/m', 0))\n"
        "print(sorted(m for m in ('vllm', 'sglang', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "vllm" not in out.stdout and "sglang" not in out.stdout, out.stdout
