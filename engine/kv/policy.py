"""Eviction policies: which evictable (cached, unreferenced) block to reuse when the pool needs space.

The block pool owns the blocks; a policy only orders the evictable ones. LRU is the default. `ReusePolicy`
follows "KVCache Cache in the Wild" (Alibaba, 2025): reuse is hard to predict across all requests but
regular within a workload class, so it learns per class how often and how soon idle blocks come back and
evicts the block least likely to be reused while it could still stay cached.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.engine.protocol import OPENING_TOKENS


@dataclass(frozen=True)
class BlockUse:
    """What the pool knows about a block when it becomes evictable: the workload class of the request that
    last held it and the block's index in that request's table (0 is the first block of the prompt)."""

    workload: str = ""
    offset: int = 0
    block_hash: int | None = None


NO_USE = BlockUse()


class EvictionPolicy(Protocol):
    """Orders evictable blocks. The pool calls `add` when a block becomes evictable and `remove` when it is
    referenced again; `pop_victim` takes the block to evict next."""

    def add(self, block_id: int, use: BlockUse = NO_USE) -> None: ...

    def remove(self, block_id: int) -> None: ...

    def pop_victim(self) -> int: ...

    def __len__(self) -> int: ...

    def __contains__(self, block_id: int) -> bool: ...


class LRUPolicy:
    """Least recently used first. The pool frees a request's blocks tail first, so among blocks released
    together the deepest (least shareable) go before the prefix they extend."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def add(self, block_id: int, use: BlockUse = NO_USE) -> None:
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


class ReuseModel:
    """How idle blocks of one class come back, from decayed counts (recent behaviour weighs most).

    The model is a hurdle: a block that goes idle is reused with probability `p`, after an exponential gap.
    `p` is reuses over idle periods begun, both counted as they happen, so it follows a class whose share
    grows (counting evictions as "not reused" instead would lag by the cache's lifetime and overrate growing
    classes). Both shrink toward `prior` while the class has few observations, so a new class starts from
    the pooled behaviour, not from nothing.
    """

    def __init__(self, memory: float, prior: ReuseModel | None = None, prior_weight: float = 20.0) -> None:
        self.decay = 1.0 - 1.0 / memory
        self.prior = prior
        self.prior_weight = prior_weight
        self.idles = 0.0  # idle periods begun
        self.hits = 0.0  # reuses (in the cache, or of an evicted block, seen when it comes back)
        self.gap_sum = 0.0

    def observe_idle(self) -> None:
        self.idles = self.idles * self.decay + 1.0
        self.hits *= self.decay
        self.gap_sum *= self.decay

    def observe_hit(self, gap: float) -> None:
        self.idles *= self.decay
        self.hits = self.hits * self.decay + 1.0
        self.gap_sum = self.gap_sum * self.decay + max(gap, 0.0)

    def params(self) -> tuple[float, float]:
        """(p, mean gap in seconds)."""
        if self.prior is None:
            p0, gap0 = 0.5, 60.0
        else:
            p0, gap0 = self.prior.params()
        w = self.prior_weight
        p = min((self.hits + w * p0) / (self.idles + w), 1.0)
        mean_gap = (self.gap_sum + w * gap0) / (self.hits + w)
        return p, max(mean_gap, 1e-6)

    def reuse_probability(self, idle: float, lifetime: float) -> float:
        """P(hit within the next `lifetime` seconds | idle for `idle` seconds so far). Falls with `idle`
        (the longer a block waits, the likelier it belongs to the never-reused part), so within one class
        the longest idle block is always the least likely: one ordered queue per class suffices."""
        p, mean_gap = self.params()
        if p >= 1.0:
            return 1.0 - math.exp(-lifetime / mean_gap)
        still = p * math.exp(-idle / mean_gap)  # P(reused, and not yet)
        return still * -math.expm1(-lifetime / mean_gap) / (still + 1.0 - p)


@dataclass
class _Idle:
    since: float
    offset: int
    block_hash: int | None


class ReusePolicy:
    """Evicts the block least likely to be reused within its expected lifetime in the cache, then the one
    farthest from the start of its prompt.

    Blocks are queued per workload class in the order they became idle; since the reuse probability falls
    with idle time within a class, each queue's head is its class's best victim, and an eviction compares
    only the heads (cost grows with the number of classes, not blocks). The expected lifetime is the idle
    age at which recent victims left. Evicted blocks are remembered by hash for a while (`ghost_factor`
    times the most blocks ever idle), so a block recomputed after its eviction still counts as a reuse.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, memory: float = 2000.0,
                 ghost_factor: float = 2.0) -> None:
        self.clock = clock
        self.memory = memory
        self.ghost_factor = ghost_factor
        self._ghosts: OrderedDict[int, tuple[str, float]] = OrderedDict()  # evicted hash -> (class, idle since)
        self._most = 0
        self.pooled = ReuseModel(memory)
        self.models: dict[str, ReuseModel] = {}
        self.queues: dict[str, OrderedDict[int, _Idle]] = {}
        self._class_of: dict[int, str] = {}
        self.lifetime = math.inf  # seconds a block stays idle before eviction (decayed mean over victims)

    def model(self, workload: str) -> ReuseModel:
        model = self.models.get(workload)
        if model is None:
            model = self.models[workload] = ReuseModel(self.memory, prior=self.pooled)
            self.queues[workload] = OrderedDict()
        return model

    def add(self, block_id: int, use: BlockUse = NO_USE) -> None:
        if block_id in self._class_of:
            raise AssertionError(f"block {block_id} is already evictable")
        self.model(use.workload).observe_idle()
        self.pooled.observe_idle()
        now = self.clock()
        ghost = None if use.block_hash is None else self._ghosts.pop(use.block_hash, None)
        if ghost is not None:  # evicted, recomputed: a reuse the cache missed
            self.models[ghost[0]].observe_hit(now - ghost[1])
            self.pooled.observe_hit(now - ghost[1])
        self.queues[use.workload][block_id] = _Idle(now, use.offset, use.block_hash)
        self._class_of[block_id] = use.workload
        self._most = max(self._most, len(self._class_of))

    def remove(self, block_id: int) -> None:
        """A cached block is hit again: a reuse gap for its class."""
        workload = self._class_of.pop(block_id)
        idle = self.queues[workload].pop(block_id)
        gap = self.clock() - idle.since
        self.models[workload].observe_hit(gap)
        self.pooled.observe_hit(gap)

    def pop_victim(self) -> int:
        now = self.clock()
        best: tuple[float, int, str] | None = None
        for workload, queue in self.queues.items():
            if not queue:
                continue
            idle = next(iter(queue.values()))
            score = self.models[workload].reuse_probability(now - idle.since, self.lifetime)
            key = (score, -idle.offset, workload)
            if best is None or key < best:
                best = key
        if best is None:
            raise KeyError("no evictable block")
        workload = best[2]
        block_id, idle = self.queues[workload].popitem(last=False)
        del self._class_of[block_id]
        if idle.block_hash is not None:
            self._ghosts[idle.block_hash] = (workload, idle.since)
        while len(self._ghosts) > self.ghost_factor * self._most:
            self._ghosts.popitem(last=False)
        age = now - idle.since
        self.lifetime = age if math.isinf(self.lifetime) else 0.99 * self.lifetime + 0.01 * age
        return block_id

    def __len__(self) -> int:
        return len(self._class_of)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._class_of


class OpeningCounter:
    """How many earlier requests opened with the same first `opening_tokens` tokens: the prefix-reuse signal of
    `workload_class`. Counts what was seen, not what is still cached, so an eviction cannot change a class.
    Keeps the `capacity` most recent openings (bounded memory)."""

    def __init__(self, opening_tokens: int = OPENING_TOKENS, capacity: int = 1 << 16) -> None:
        self.opening_tokens = opening_tokens
        self.capacity = capacity
        self._counts: OrderedDict[int, int] = OrderedDict()

    def seen(self, block_hashes: Sequence[int], block_size: int) -> int | None:
        """Earlier requests with the same opening, and count this one; None when no block is full yet."""
        if not block_hashes:
            return None
        key = block_hashes[min(len(block_hashes), max(1, self.opening_tokens // block_size)) - 1]
        count = self._counts.pop(key, 0)
        self._counts[key] = count + 1
        if len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return count


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "reuse": ReusePolicy}


def make_policy(name: str, clock: Callable[[], float] | None = None) -> EvictionPolicy:
    """The policy registered under `name` (a policy that reads time uses `clock`, default time.monotonic);
    ValueError names the known ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}")
    if name == "reuse":
        return ReusePolicy(clock or time.monotonic)
    return POLICIES[name]()
