"""What a shared-buffer sync keeps for the next one, so that a trainer streaming the same
model step after step pays no per-tensor host work twice: on the sender, the buckets that
receivers read wholly in place (`Replay`); on the receiver, the zero-copy views handed to
`load_weights` (`ViewCache`).

Knows nothing about how buffers are shared or how buckets travel.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import ClassVar

import torch

from offbeat.ckpt_engine.bucket import Entry, Reassembler, dtype_from_str


class Replay:
    """A bucket of the previous sync that receivers read wholly in place, replayed as it was
    when the same tensors (the same objects at the same addresses, in the same order) come
    again: a trainer's next step costs no planning or sharing per tensor."""

    __slots__ = ("keys", "msg", "raw", "sids", "tensors")

    def __init__(self, tensors: list, msg: dict, raw: bytes, keys: list, sids: dict) -> None:
        self.tensors, self.msg, self.keys, self.sids = tensors, msg, keys, sids
        self.raw = raw  # msg encoded once: a replay sends the same bytes

    def take(self, it: Iterator) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        """The next (name, tensor) pairs of `it`, and whether they are this bucket's."""
        taken = []
        for name, ref, ptr in self.tensors:
            nxt = next(it, None)
            if nxt is None:
                return taken, False
            taken.append(nxt)
            if nxt[0] != name or ref() is not nxt[1] or nxt[1].data_ptr() != ptr:
                return taken, False
        return taken, True


class ViewCache:
    """Zero-copy views of whole tensors, kept across syncs: the same model streamed the
    same way lands at the same offsets of the same buffers every time, and building
    hundreds of views per sync costs more host time than the device copies they feed.

    A cache holds its base tensors (so their ids stay unique) and is trimmed after each
    sync to the bases that sync used."""

    _caches: ClassVar[dict[str, ViewCache]] = {}

    def __init__(self) -> None:
        self._views: dict[tuple, torch.Tensor] = {}
        self._bases: dict[int, torch.Tensor] = {}
        self._used: set[int] = set()
        # A whole bucket's list, reused when the same entries arrive in the same buffer and
        # storages again (a trainer's next step): no per-tensor work at all then.
        self._memo: dict[tuple, tuple[list, dict, list[torch.Tensor], list]] = {}
        self._memo_used: set[tuple] = set()
        # Bucket messages read wholly in place, by index: (encoded, decoded). A replayed
        # bucket comes again byte for byte, and decoding hundreds of storage descriptors
        # per sync costs more than comparing the bytes.
        self._msgs: dict[int, tuple[bytes, dict]] = {}
        self._msgs_used: dict[int, tuple[bytes, dict]] = {}

    @classmethod
    def get(cls, key: str) -> ViewCache:
        return cls._caches.setdefault(key, cls())

    def decoded(self, index: int, raw: bytes) -> dict:
        """Message `index` of this sync, decoded (or as decoded before, if the same bytes)."""
        known = self._msgs.get(index)
        msg = known[1] if known is not None and known[0] == raw else json.loads(raw)
        if msg.get("noack"):
            self._msgs_used[index] = (raw, msg)
        return msg

    def take(
        self,
        entries: list[list],
        buffer: torch.Tensor,
        ext_at: dict[int, tuple[torch.Tensor, int]],
        reasm: Reassembler,
        ext_raw: dict | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        bases = [buffer, *(b for b, _ in ext_at.values())]
        key = (id(buffer), len(entries), entries[0][0] if entries else "")
        memo = self._memo.get(key)
        if (
            memo is not None
            and memo[0] == entries
            and memo[1] == ext_raw
            and len(memo[2]) == len(bases)
            and all(a is b for a, b in zip(memo[2], bases, strict=True))
        ):
            self._memo_used.add(key)
            self._used.update(id(b) for b in bases)
            return list(memo[3])
        out: list[tuple[str, torch.Tensor]] = []
        cacheable = True
        for i, e in enumerate(entries):
            name, dtype, shape, offset, nbytes, start, total = e
            base, at = ext_at.get(i, (buffer, offset))
            if start or nbytes != total or not nbytes:  # split or empty: the slow path
                cacheable = False
                piece = base[at : at + nbytes]
                out.extend(
                    reasm.take([Entry(name, dtype, tuple(shape), 0, nbytes, start, total)], piece)
                )
                continue
            self._bases[id(base)] = base
            self._used.add(id(base))
            vkey = (id(base), at, nbytes, dtype, *shape)
            t = self._views.get(vkey)
            if t is None:
                t = base[at : at + nbytes].view(dtype_from_str(dtype)).view(shape)
                self._views[vkey] = t
            out.append((name, t))
        if cacheable:
            self._memo[key] = (entries, ext_raw, bases, list(out))
            self._memo_used.add(key)
        return out

    def trim(self) -> None:
        # The same stream as last time (a trainer's step) used everything: nothing to drop.
        if not self._used.issuperset(self._bases):
            for b in [b for b in self._bases if b not in self._used]:
                del self._bases[b]
            self._views = {k: v for k, v in self._views.items() if k[0] in self._used}
        if not self._memo_used.issuperset(self._memo):
            self._memo = {k: v for k, v in self._memo.items() if k in self._memo_used}
        self._used = set()
        self._memo_used = set()
        self._msgs, self._msgs_used = self._msgs_used, {}
