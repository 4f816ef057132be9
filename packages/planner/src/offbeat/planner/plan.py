"""The planner: which split of N devices, which replicas x TP, which staleness bound and
mode run a job fastest, by simulating each candidate on a profile.

Knows the job config only through the keys it reads (`sim_config_from_job`) and writes
(`Candidate.overrides`); knows nothing about engines or files. A candidate's speed is its
simulated step time: every candidate trains the same batch per step, so a shorter step is
more trained tokens per second. Ties go to the smaller staleness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from offbeat.planner.profile import SCALING_ASSUMPTIONS, Profile
from offbeat.planner.simulator import SimConfig, SimResult, simulate

if TYPE_CHECKING:
    from offbeat.core.config.run import RunConfig

__all__ = [
    "Candidate",
    "PlanRequest",
    "candidates",
    "plan",
    "predict",
    "rank",
    "replica_devices_of",
    "sim_config_from_job",
    "sweep",
]

TP_CHOICES = (1, 2, 4, 8)
SINGLE_MACHINE_BACKENDS = ("shm", "cuda_ipc")


def replica_devices_of(cfg: RunConfig, replicas: int) -> tuple[int, ...]:
    """The device each of `replicas` rollout replicas decodes on, as the job places them:
    on CPU, replicas with the same share of `runtime.rollout_cpus` share those cores (two
    replicas on one core), and unpinned ones share the machine; on GPUs each replica has
    devices of its own (empty: none shared)."""
    from offbeat.core.cpus import share_of

    if cfg.resources.device != "cpu" or replicas < 2:
        return ()
    rt = getattr(cfg, "runtime", None)
    cpus = list(getattr(rt, "rollout_cpus", None) or [])
    if not cpus:
        return (0,) * replicas
    ids: dict[tuple[int, ...], int] = {}
    return tuple(
        ids.setdefault(tuple(share_of(cpus, replicas, i)), len(ids)) for i in range(replicas)
    )


def sim_config_from_job(cfg: RunConfig, profile: Profile, *, steps: int | None = None) -> SimConfig:
    """The simulator's view of a (validated) job config."""
    a, s, t, r = cfg.async_training, cfg.actor, cfg.trainer, cfg.resources
    rt = getattr(cfg, "runtime", None)
    # The trainer pads to the batch's longest prompt: the profiled padded width less the
    # longest response is that prompt width.
    padded = float(profile.job.get("padded_len_mean") or 0.0)
    longest = max(profile.rollout.response_lengths or [cfg.rollout.max_tokens])
    prompt_len = (
        padded - longest if padded > longest
        else float(profile.job.get("prompt_len_mean") or cfg.data.max_prompt_length)
    )  # fmt: skip
    replicas = max(1, r.rollout_devices // cfg.rollout.tensor_parallel_size)
    return SimConfig(
        mode=t.mode,
        steps=steps if steps is not None else min(t.total_training_steps, 12),
        train_batch_size=cfg.data.train_batch_size,
        n=cfg.rollout.n,
        ppo_mini_batch_size=s.ppo_mini_batch_size,
        parameter_sync_step=a.parameter_sync_step,
        ppo_epochs=s.ppo_epochs,
        max_off_policy_threshold=a.max_off_policy_threshold,
        max_off_policy_strategy=a.max_off_policy_strategy,
        num_warmup_batches=a.num_warmup_batches,
        trainer_devices=r.trainer_devices,
        replicas=replicas,
        replica_devices=replica_devices_of(cfg, replicas),
        tp=cfg.rollout.tensor_parallel_size,
        max_concurrent_groups=getattr(rt, "max_concurrent_groups", 64) if rt else 64,
        prompt_len=prompt_len,
        max_tokens=cfg.rollout.max_tokens,
        test_freq=t.test_freq,
        val_before_train=False,  # before step 1: outside every step's time
        hybrid=bool(t.validate_on_trainer_devices),
        old_log_prob_source=cfg.algorithm.old_log_prob_source,
        seed=t.seed,
    )


def predict(cfg: RunConfig, profile: Profile, *, steps: int | None = None) -> SimResult:
    """The simulated run of `cfg` as given."""
    return simulate(sim_config_from_job(cfg, profile, steps=steps), profile)


@dataclass
class Candidate:
    mode: str
    trainer_devices: int
    replicas: int
    tp: int
    threshold: int
    strategy: str
    num_warmup_batches: int
    replica_devices: tuple[int, ...] = ()  # shared devices (see SimConfig); empty: none
    result: SimResult | None = None

    @property
    def rollout_devices(self) -> int:
        return self.replicas * self.tp

    def label(self) -> str:
        if self.mode == "sync":
            return "sync"
        return f"async {self.strategy} t={self.threshold}"

    def staleness_mean(self) -> float:
        st = self.result.staleness if self.result else {}
        total = sum(st.values())
        return sum(k * v for k, v in st.items()) / total if total else 0.0

    def overrides(self, nodes: int, devices: int, cfg: RunConfig | None = None) -> list[str]:
        """The overrides that run this candidate; with `cfg`, also what the split makes
        necessary beyond it (a weight sync that crosses machines on many nodes)."""
        out = [
            f"resources.num_nodes={nodes}",
            f"resources.devices_per_node={devices // nodes}",
            f"resources.trainer_devices={self.trainer_devices}",
            f"resources.rollout_devices={self.rollout_devices}",
            f"rollout.tensor_parallel_size={self.tp}",
            f"trainer.mode={self.mode}",
        ]
        if self.mode == "separate_async":
            out += [
                f"async_training.max_off_policy_threshold={self.threshold}",
                f"async_training.max_off_policy_strategy={self.strategy}",
                f"async_training.num_warmup_batches={self.num_warmup_batches}",
            ]
        rt = getattr(cfg, "runtime", None)
        if nodes > 1 and getattr(rt, "ckpt_backend", None) in SINGLE_MACHINE_BACKENDS:
            out.append("runtime.ckpt_backend=broadcast")  # shm / CUDA IPC stay on one machine
        return out


@dataclass
class PlanRequest:
    devices: int
    nodes: int = 1
    modes: tuple[str, ...] = ("sync", "separate_async")
    thresholds: tuple[int, ...] = (1, 2, 3, 4)
    strategies: tuple[str, ...] = ("drop", "wait")
    tp_choices: tuple[int, ...] = TP_CHOICES
    steps: int = 10
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.devices < 2:
            raise ValueError(
                f"--devices={self.devices}: need >= 2 (one for training, one for rollout)"
            )
        if self.nodes < 1 or self.devices % self.nodes:
            raise ValueError(
                f"--nodes={self.nodes}: must divide --devices={self.devices} (devices per node)"
            )


def _trainer_sizes(devices: int, per_node: int) -> list[int]:
    """Trainer sizes worth trying: powers of two and whole nodes, leaving rollout >= 1."""
    sizes = {1 << k for k in range(devices.bit_length()) if (1 << k) < devices}
    sizes |= {k * per_node for k in range(1, devices // per_node) if k * per_node < devices}
    return sorted(sizes)


def candidates(cfg: RunConfig, req: PlanRequest, profile: Profile) -> list[Candidate]:
    """Every split of `req.devices` the job config's rules accept."""
    rows = cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    mp = cfg.actor.tensor_model_parallel_size * cfg.actor.pipeline_model_parallel_size
    out = sweep(req, profile, rows=rows, model_parallel=mp)
    for c in out:  # as the job would place them with the config's cores
        c.replica_devices = replica_devices_of(cfg, c.replicas)
    return out


def sweep(
    req: PlanRequest, profile: Profile, *, rows: int, model_parallel: int = 1
) -> list[Candidate]:
    """The candidates: trainer sizes whose data-parallel ranks split `rows` (a mini-batch's
    trajectories) evenly, TP choices within a node and not narrower than profiled."""
    per_node = req.devices // req.nodes
    mp = model_parallel
    min_tp = max(1, int(profile.rollout.tp))  # never narrower than measured (memory)
    out = []
    for td in _trainer_sizes(req.devices, per_node):
        if td % mp or rows % (td // mp):
            continue
        rd = req.devices - td
        for tp in req.tp_choices:
            if tp < min_tp or tp > per_node or rd % tp:
                continue
            for mode in req.modes:
                if mode == "sync":
                    out.append(Candidate("sync", td, rd // tp, tp, 1, "drop", 0))
                    continue
                for strategy in req.strategies:
                    for th in req.thresholds:
                        # The deepest pipeline the bound allows (drop: depth <= threshold).
                        c = Candidate("separate_async", td, rd // tp, tp, th, strategy, th - 1)
                        out.append(c)
    return out


def plan(cfg: RunConfig, req: PlanRequest, profile: Profile) -> list[Candidate]:
    """Every candidate simulated, fastest first."""
    base = sim_config_from_job(cfg, profile, steps=req.steps)
    return rank(base, candidates(cfg, req, profile), profile)


def rank(base: SimConfig, cands: list[Candidate], profile: Profile) -> list[Candidate]:
    """Simulate each candidate on `base` (the job's other knobs); fastest first."""
    done = []
    for c in cands:
        sc = dataclasses.replace(
            base, mode=c.mode, trainer_devices=c.trainer_devices, replicas=c.replicas, tp=c.tp,
            max_off_policy_threshold=c.threshold, max_off_policy_strategy=c.strategy,
            num_warmup_batches=c.num_warmup_batches, replica_devices=c.replica_devices,
        )  # fmt: skip
        c.result = simulate(sc, profile)
        done.append(c)
    done.sort(key=lambda c: (round(c.result.step_s, 6), c.staleness_mean(), c.trainer_devices))
    return done


def format_table(ranked: list[Candidate], top: int = 15) -> str:
    head = (
        "| rank | mode | trainer dev | replicas x TP | step_s | tokens/s | trainer idle "
        "| rollout idle | staleness mean | evicted |"
    )
    lines = [head, "|" + "---|" * 10]
    for i, c in enumerate(ranked[:top], 1):
        r = c.result
        assert r is not None
        lines.append(
            f"| {i} | {c.label()} | {c.trainer_devices} | {c.replicas} x {c.tp} | "
            f"{r.step_s:.3f} | {r.tokens_per_s:.1f} | {r.trainer_idle:.2f} | "
            f"{r.rollout_idle:.2f} | {c.staleness_mean():.2f} | {r.evictions} |"
        )
    if len(ranked) > top:
        lines.append(f"({len(ranked) - top} more candidates not shown)")
    return "\n".join(lines)


def assumptions(profile: Profile, req: PlanRequest) -> list[str]:
    measured = (
        f"profile measured with {profile.trainer.devices} trainer device(s), one replica at "
        f"TP {profile.rollout.tp} on {profile.job.get('device', '?')}"
    )
    extra = [
        f"trainer.dp_efficiency={profile.trainer.dp_efficiency} per doubling, "
        f"rollout.tp_efficiency={profile.rollout.tp_efficiency} per doubling "
        "(assumed unless the profile measured them)",
        "replicas are never narrower than the profiled TP (the model must fit)",
        f"{req.steps} simulated steps per candidate, the first left out of the averages",
    ]
    return [measured, *SCALING_ASSUMPTIONS, *extra]
