"""Eviction policies: which evictable (cached, unreferenced) block to reuse when the pool needs space.

The block pool owns the blocks; a policy only orders the evictable ones. Another policy (reuse probability
per workload class, then block offset) plugs in behind the same interface.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    """Orders evictable blocks. The pool calls `add` when a block becomes evictable and `remove` when it is
    referenced again; `pop_victim` takes the block to evict next."""

    def add(self, block_id: int) -> None: ...

    def remove(self, block_id: int) -> None: ...

    def pop_victim(self) -> int: ...

    def __len__(self) -> int: ...

    def __contains__(self, block_id: int) -> bool: ...


class LRUPolicy:
    """Least recently used first. The pool frees a request's blocks tail first, so among blocks released
    together the deepest (least shareable) go before the prefix they extend."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int) -> None:
        self._order[block_id] = None
        self._order.move_to_end(block_id)

    def remove(self, block_id: int) -> None:
        del self._order[block_id]

    def pop_victim(self) -> int:
        block_id, _ = self._order.popitem(last=False)
        return block_id

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order


POLICIES = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """The policy registered under `name`; ValueError names the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
