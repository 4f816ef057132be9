"""Cache-aware routing: send a prompt where its prefix most likely sits in the KV cache.

Knows nothing about the servers' real caches: it remembers, in bounded LRU maps, which server
incarnation last received each block of a prompt (a chained hash of `block_size` token ids,
so one hash stands for the whole prefix up to that block) and which server each GRPO group
went to. It prefers that server unless load would become unbalanced beyond both thresholds
(absolute and relative, as the SGLang router does); then it falls back to the least loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from offbeat.balancer.policies import Policy, register_policy
from offbeat.balancer.pool import Server, ServerPool

__all__ = ["PrefixAware", "block_hashes"]


def block_hashes(prompt_ids: Sequence[int], block_size: int = 16) -> list[int]:
    """Chained hashes of the full blocks of `prompt_ids` (a partial last block is not cached).

    Hash i covers tokens [0, (i+1) * block_size): two prompts share hash i exactly when they
    share that whole prefix (up to hash collisions). Ints and tuples of ints hash the same in
    every process, so the values are stable.
    """
    if isinstance(prompt_ids, (list, tuple)):
        ids = prompt_ids
    elif hasattr(prompt_ids, "tolist"):  # numpy arrays, torch tensors: hash the ints
        ids = prompt_ids.tolist()
    else:
        ids = list(prompt_ids)
    out: list[int] = []
    h = 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = hash((h, *ids[start : start + block_size]))
        out.append(h)
    return out


@register_policy("prefix")
class PrefixAware(Policy):
    """Prefix-cache-aware routing with GRPO group affinity and SGLang-style balance guards.

    - `group_id` seen before: its server, so the n samples of a prompt share one prefill.
    - otherwise the server that last received the longest prefix of `prompt_ids`, if that
      prefix covers at least `cache_threshold` of the prompt's blocks.
    - the preferred server is used unless, counting this request, its load exceeds the least
      loaded server's by more than `balance_abs_threshold` AND by more than a factor
      `balance_rel_threshold`; then the least loaded server is used (and remembered).

    Memory is bounded: at most `max_blocks` block hashes and `max_groups` groups (LRU).
    """

    name = "prefix"

    def __init__(
        self,
        *,
        block_size: int = 16,
        max_blocks: int = 1 << 18,
        max_groups: int = 1 << 16,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 8,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        for key, value, lo in (
            ("block_size", block_size, 1),
            ("max_blocks", max_blocks, 1),
            ("max_groups", max_groups, 1),
            ("balance_abs_threshold", balance_abs_threshold, 0),
        ):
            if type(value) is not int or value < lo:
                raise ValueError(f"{key} must be an int >= {lo}, got {value!r}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if not balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold!r}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.max_groups = max_groups
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._blocks: OrderedDict[int, Server] = OrderedDict()
        self._groups: OrderedDict[Any, Server] = OrderedDict()

    def __len__(self) -> int:
        """Block hashes remembered (bounded by `max_blocks`)."""
        return len(self._blocks)

    def select(self, pool: ServerPool, request_id, group_id, prompt_ids, cost):
        least = pool.least_loaded(cost)
        if least is None:
            return None
        preferred: Server | None = None
        if group_id is not None:
            srv = self._groups.get(group_id)
            if srv is not None and srv.accepting:
                preferred = srv
        hashes = block_hashes(prompt_ids, self.block_size) if prompt_ids else []
        if preferred is None and hashes:
            matched, srv = self._longest_match(hashes)
            if srv is not None and matched >= self.cache_threshold * len(hashes):
                preferred = srv
        chosen = least
        if (
            preferred is not None
            and preferred is not least
            and pool.has_room(preferred, cost)
            and not self._unbalanced(preferred.inflight + cost, least.inflight)
        ):
            chosen = preferred
        self._remember(chosen, group_id, hashes)
        return chosen

    def _unbalanced(self, load: int, least: int) -> bool:
        return (
            load - least > self.balance_abs_threshold and load > self.balance_rel_threshold * least
        )

    def _longest_match(self, hashes: list[int]) -> tuple[int, Server | None]:
        blocks = self._blocks
        for i in range(len(hashes) - 1, -1, -1):
            srv = blocks.get(hashes[i])
            if srv is not None and srv.accepting:
                return i + 1, srv
        return 0, None

    def _remember(self, srv: Server, group_id: Any, hashes: list[int]) -> None:
        if group_id is not None:
            groups = self._groups
            groups[group_id] = srv
            groups.move_to_end(group_id)
            if len(groups) > self.max_groups:
                groups.popitem(last=False)
        if hashes:
            blocks = self._blocks
            for h in hashes:
                blocks[h] = srv
                blocks.move_to_end(h)
            while len(blocks) > self.max_blocks:
                blocks.popitem(last=False)
