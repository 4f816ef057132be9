"""Every registered rollout-engine factory takes the calls the job makes: a replica of the
rollout pool (its bundle's `scheduling_strategy`), a hybrid replica (its own name, its
trainer rank's cores, its place in the trainer pool) and a replacement (a new name, the
dead one's bundle). The actor start is recorded, not run: what each factory hands to Ray
is checked. (`rollout.engine=sglang` once stopped at the first call with a TypeError.)"""

from __future__ import annotations

import pytest

from offbeat.core.cli import load_recipe_config
from offbeat.core.registry import ROLLOUT_ENGINES
from offbeat.core.runtime.launch import hybrid_options, replica_options


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


def recorded(monkeypatch, engine: str) -> list[dict]:
    calls: list[dict] = []

    def start(config, *, cpus=None, **options):
        calls.append({"config": config, "cpus": list(cpus or []), **options})
        return object()

    if engine == "vllm":
        import offbeat.rollout_vllm.actor as actor

        monkeypatch.setattr(actor, "vllm_server_actor", start)
    else:
        import offbeat.rollout_sglang.replica as replica

        monkeypatch.setattr(replica, "sglang_server_actor", start)
    return calls


def job(engine: str):
    import dataclasses

    _, cfg = load_recipe_config(
        "separate_async",
        [f"rollout.engine={engine}", "resources.devices_per_node=3",
         "resources.rollout_devices=2", "runtime.trainer_cpus=[]", "runtime.rollout_cpus=[0,1]"],
    )  # fmt: skip
    if engine == "sglang":  # the recipe's engine_kwargs are vLLM's (the factory refuses them)
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine_kwargs={}))
    return cfg


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_engine_factory_takes_the_jobs_calls(monkeypatch, engine):
    assert engine in ROLLOUT_ENGINES.names()
    calls = recorded(monkeypatch, engine)
    cfg = job(engine)
    factory = ROLLOUT_ENGINES.get(engine)
    pools = FakePools()
    for i in range(2):  # start_replicas
        factory(cfg, "/m", i, **replica_options(pools, i))
    # a hybrid replica (elastic.start_hybrid_replicas)
    factory(cfg, "/m", 0, server_id="hybrid-0", cpus=[1], **hybrid_options(cfg, pools, 0))
    # a replacement (elastic.replacement_for)
    factory(cfg, "/m", 1, server_id="rollout-1-r1", **replica_options(pools, 1))

    ids = [c["config"].server_id for c in calls]
    assert ids == ["rollout-0", "rollout-1", "hybrid-0", "rollout-1-r1"]
    strategies = [c["scheduling_strategy"] for c in calls]
    assert strategies == [
        "rollout-bundle-0",
        "rollout-bundle-1",
        "trainer-bundle-0",
        "rollout-bundle-1",
    ]
    # each replica's share of runtime.rollout_cpus; the hybrid one its rank's cores
    assert [c["cpus"] for c in calls] == [[0], [1], [1], [1]]
    assert calls[2]["num_gpus"] == 0 and calls[0]["num_cpus"] == cfg.runtime.rollout_num_cpus


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_every_engine_factory_sends_its_replica_to_a_file_of_its_own(monkeypatch, engine):
    """Each replica's process writes to <log_dir>/<experiment_name>/logs/<server_id>.log
    (offbeat.core.process_log); with trainer.verbose it stays where Ray forwards it."""
    import dataclasses

    from offbeat.core.process_log import LOG_ENV, RAY_SETUP_HOOK_ENV, replica_log_path

    calls = recorded(monkeypatch, engine)
    cfg = job(engine)
    factory = ROLLOUT_ENGINES.get(engine)
    factory(cfg, "/m", 0, **replica_options(FakePools(), 0))
    factory(cfg, "/m", 0, server_id="hybrid-0", cpus=[1])
    envs = [c.get("runtime_env", {}).get("env_vars", {}) for c in calls]
    want = [replica_log_path(cfg, "rollout-0"), replica_log_path(cfg, "hybrid-0")]
    assert [e.get(LOG_ENV) for e in envs] == [str(p) for p in want]
    assert want[1].name == "hybrid-0.log" and want[1].parent.name == "logs"
    assert all(RAY_SETUP_HOOK_ENV in e for e in envs)
    calls.clear()
    verbose = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, verbose=True))
    factory(verbose, "/m", 0, **replica_options(FakePools(), 0))
    env = calls[0].get("runtime_env", {}).get("env_vars", {})
    assert LOG_ENV not in env and RAY_SETUP_HOOK_ENV not in env
