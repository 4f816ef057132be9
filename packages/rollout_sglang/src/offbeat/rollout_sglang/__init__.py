"""offbeat-rollout-sglang: an SGLang server as an offbeat RolloutServer and weight-sync
target, over SGLang's native HTTP API (token ids in, token ids + log-probs out).

Importing this package does not import SGLang: the server runs as its own process
(`python -m sglang.launch_server`), started by the replica's Ray actor.
"""

from offbeat.rollout_sglang._http import SGLangHTTP, SGLangHTTPError, SGLangRequestRejected
from offbeat.rollout_sglang._process import SGLangProcess
from offbeat.rollout_sglang._weights import SUPPORTED_BACKENDS, update_plan
from offbeat.rollout_sglang.replica import sglang_proxy, sglang_replica, sglang_server_actor
from offbeat.rollout_sglang.server import SGLangRolloutServer, SGLangServerConfig

__all__ = [
    "SUPPORTED_BACKENDS",
    "SGLangHTTP",
    "SGLangHTTPError",
    "SGLangProcess",
    "SGLangRequestRejected",
    "SGLangRolloutServer",
    "SGLangServerConfig",
    "sglang_proxy",
    "sglang_replica",
    "sglang_server_actor",
    "update_plan",
]
