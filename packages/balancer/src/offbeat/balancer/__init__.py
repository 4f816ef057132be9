"""offbeat-balancer: route requests to LLM server replicas by lease (stdlib only).

The core (`LoadBalancer`) is plain thread-safe Python; `offbeat.balancer.aio` adds an asyncio
wrapper that waits for capacity and `offbeat.balancer.actor` a Ray actor (extra `[ray]`).
"""

from offbeat.balancer.balancer import LoadBalancer
from offbeat.balancer.lease import Lease, NoServerAvailable
from offbeat.balancer.policies import (
    LeastInflight,
    Policy,
    PowerOfTwo,
    RoundRobin,
    available_policies,
    make_policy,
    register_policy,
)
from offbeat.balancer.pool import Server, ServerPool
from offbeat.balancer.prefix import PrefixAware, block_hashes

__all__ = [  # noqa: RUF022 (grouped by concept, sorted within each group)
    # the balancer and its leases
    "Lease",
    "LoadBalancer",
    "NoServerAvailable",
    # policies and their registry
    "LeastInflight",
    "Policy",
    "PowerOfTwo",
    "PrefixAware",
    "RoundRobin",
    "available_policies",
    "block_hashes",
    "make_policy",
    "register_policy",
    # what a policy sees
    "Server",
    "ServerPool",
]
