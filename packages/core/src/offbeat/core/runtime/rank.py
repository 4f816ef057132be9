"""One data-parallel trainer rank, as it runs inside its Ray actor.

A `TrainerRank` joins the torch.distributed group that rank 0 published (env://
variables), then builds the engines of its roles: the policy's train engine from the
`TRAIN_ENGINES` registry (`actor.engine`, so any registered engine joins the same
group), the critic (`build_critic_engine`, `critic.engine`) and the frozen reference
policy (`build_reference_engine`), each sharded over the same ranks. It runs what the
driver's `TrainerGroup` fans out: updates, log-probs and values on its shard of a batch,
sharded save/load, and its part of a weight sync, where rank 0 is the checkpoint
engine's sender and every rank takes part in each parameter's gather (nothing goes
through the driver). The same class runs in the driver as the one rank of a local
group (`runtime.trainer_in_driver`, `runtime.local`): no rendezvous then (a private
single-process group) and no reseeding (the driver's `prepare` seeded the process).
Knows nothing about the other ranks beyond the rendezvous address, nor about the
replicas it sends to.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = ["ROLES", "TrainerRank"]

# What a rank may build: the policy (the engine the training loop drives and syncs), the
# critic (value model) and the reference policy.
ROLES = ("actor", "critic", "reference")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class TrainerRank:
    """`rank` of `world` ranks; `cpus` confines this process (empty: no confinement).
    Call `address()` on rank 0 first, then `build(...)` on every rank at once."""

    def __init__(self, rank: int, world: int, cpus: list[int] | None = None) -> None:
        self.rank, self.world = rank, world
        self.engine: Any = None  # the actor's
        self.critic: Any = None
        self.reference: Any = None
        # Rank 0: the checkpoint-engine backends, kept across syncs, and the open senders,
        # by slot (one per manager: the rollout replicas', the hybrid replicas').
        self._backends: dict[str, Any] = {}
        self._senders: dict[str, Any] = {}
        if cpus:
            from offbeat.core.cpus import pin_process

            pin_process(cpus)

    # ---- setup -------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """Rank 0: (this node's IP, a free port) for the others to rendezvous at."""
        import ray

        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def build(
        self,
        job: JobConfig,
        master: tuple[str, int] | None,
        seed: int | None,
        threads: int,
        roles: tuple[str, ...] = ("actor",),
    ) -> dict:
        """Join the process group at `master` and build `job`'s engines of `roles` (in
        `ROLES` order, so the RNG draws are the same on every rank). With the reference
        it returns its weights' fingerprint (rank 0's; computed here, where the weights
        are, so the driver never needs them). `master=None`: the one rank, in the driver,
        whose engines start a private group (the env:// variables would also move its
        device to LOCAL_RANK's); `seed=None`: keep the process's RNG as it is."""
        import torch

        from offbeat.core.registry import TRAIN_ENGINES
        from offbeat.core.train import build_critic_engine, build_reference_engine

        unknown = [r for r in roles if r not in ROLES]
        if unknown or not roles:
            raise ValueError(f"trainer rank roles {list(roles)}: each one of {list(ROLES)}")
        if master is not None:
            os.environ.update(
                {
                    "MASTER_ADDR": master[0],
                    "MASTER_PORT": str(master[1]),
                    "RANK": str(self.rank),
                    "WORLD_SIZE": str(self.world),
                    "LOCAL_RANK": "0",  # Ray shows each rank only its own device
                    "LOCAL_WORLD_SIZE": "1",
                }
            )
        if seed is not None:
            torch.manual_seed(seed)
        torch.set_num_threads(threads)
        out: dict[str, Any] = {"pid": os.getpid()}
        if "actor" in roles:
            self.engine = TRAIN_ENGINES.get(job.actor.engine).from_job_config(job)
        if "critic" in roles:
            self.critic = build_critic_engine(job)
        if "reference" in roles:
            self.reference = build_reference_engine(job)
            out["reference_fingerprint"] = self._fingerprint(self.reference)
        first = next(e for e in (self.engine, self.critic, self.reference) if e is not None)
        out.update(rank=first.dp_rank, size=first.dp_size)
        return out

    def _fingerprint(self, engine: Any) -> list[float]:
        """Every rank takes part in the gather; rank 0 (which gets the full tensors with
        `gather_weights`) holds the fingerprint."""
        from offbeat.core.trainer.reference import weights_fingerprint

        gather = self._gather(engine)
        return weights_fingerprint(gather(0) if gather is not None else engine.export_weights())

    def _gather(self, engine: Any) -> Any:
        """The engine's `gather_weights` with peers to gather from; alone (world 1, the
        rank in the driver) its export hands out the parameters as they are, with no copy
        into a gather buffer."""
        return getattr(engine, "gather_weights", None) if self.world > 1 else None

    def _role(self, role: str) -> Any:
        engine = {"actor": self.engine, "critic": self.critic, "reference": self.reference}[role]
        if engine is None:
            raise RuntimeError(f"{self!r} has no {role} engine (built: {self._built()})")
        return engine

    def _built(self) -> list[str]:
        return [r for r in ROLES if getattr(self, "engine" if r == "actor" else r) is not None]

    def node_id(self) -> str:
        """This process's Ray node ("" in a driver without Ray: a unit test's local rank)."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

    def format_stacks(self) -> str:
        """This process's threads and tasks (the stall watchdog's dump asks for them). The
        group's actor runs calls on several threads, so this answers while another of its
        threads waits in a collective."""
        from offbeat.core.stacks import process_stacks

        return process_stacks()

    # ---- training ------------------------------------------------------------------------
    def update(self, shard: dict, temperature: float | None = None) -> dict[str, float]:
        return self.engine.update(shard, temperature)

    def compute_log_probs(self, shard: dict, temperature: float | None = None) -> Any:
        return self.engine.compute_log_probs(shard, temperature)

    def lr(self) -> float:
        return float(self.engine.lr)

    def global_update_count(self) -> int:
        return int(self.engine.global_update_count)

    def save(self, path: str, role: str = "actor") -> None:
        self._role(role).save(path)

    def load(self, path: str, role: str = "actor") -> None:
        self._role(role).load(path)

    # ---- the critic and the reference policy -----------------------------------------------
    def compute_values(self, shard: dict) -> Any:
        return self._role("critic").compute_values(shard)

    def update_critic(self, shard: dict) -> dict[str, float]:
        return self._role("critic").update(shard)

    def ref_log_probs(self, shard: dict, temperature: float | None = None) -> Any:
        return self._role("reference").compute_log_probs(shard, temperature)

    # ---- weight sync ---------------------------------------------------------------------
    def open_sender(
        self, backend: str, options: dict[str, Any], kwargs: dict[str, Any], slot: str = "rollout"
    ) -> list:
        """Rank 0: open the sending end of one sync of `slot` with the registered `backend`
        (built once per slot, with `options`, and kept: its buffers or process groups serve
        every sync); return every receiver's spec."""
        from offbeat.ckpt_engine import get_backend

        if slot not in self._backends:
            self._backends[slot] = get_backend(backend)(**options)
        sender = self._senders[slot] = self._backends[slot].open_sender(**kwargs)
        return [sender.spec(r) for r in range(kwargs["num_receivers"])]

    def send_weights(self, slot: str = "rollout") -> Any:
        """Every rank: iterate the engine's export to the end (each parameter's gather is a
        collective); rank 0 streams what it gathers into `slot`'s open sender and returns
        its report. An engine with `gather_weights(dst)` gathers onto rank 0 alone (the
        other ranks send their shards and hold no full tensor); else every rank gathers
        each parameter and the others drop it. Rank 0 drains the export even when the send
        stops early, so the other ranks are never left in a gather. Alone (world 1) it
        streams the export itself."""
        gather = self._gather(self.engine)
        stream = gather(0) if gather is not None else self.engine.export_weights()
        if self.rank != 0:
            for _ in stream:
                pass
            return None
        sender = self._senders.get(slot)
        if sender is None:
            raise RuntimeError(f"send_weights on rank 0 without an open sender ({slot})")
        try:
            # The sender stays reachable while it sends: the manager's drop (a receiver
            # whose health probe failed) and abort arrive on another of this rank's
            # threads, during the send, and find it under `slot`.
            return sender.send(stream)
        finally:
            if self._senders.get(slot) is sender:
                del self._senders[slot]
            for _ in stream:
                pass

    def drop_receiver(self, rank: int, reason: str, slot: str = "rollout") -> None:
        if slot in self._senders:
            self._senders[slot].drop(rank, reason)

    def abort_send(self, reason: str, slot: str = "rollout") -> None:
        if slot in self._senders:
            self._senders[slot].abort(reason)

    def close_backend(self, slot: str | None = None) -> None:
        """Close `slot`'s backend (None: every one)."""
        for name in [slot] if slot is not None else list(self._backends):
            backend = self._backends.pop(name, None)
            if backend is not None:
                backend.close()

    def __repr__(self) -> str:  # Ray prints it in log prefixes
        return f"TrainerRank({self.rank}/{self.world})"
