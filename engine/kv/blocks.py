"""The block pool, block tables and prefix cache: tensor-free accounting that works with any block size.

The engine's scheduler drives it with token ids; the trace simulators drive the same code with synthetic
ids and 512-token blocks. Nothing here touches a tensor: a block is an index into whatever KV storage the
runner owns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmesh.engine.kv.policy import BlockUse, EvictionPolicy, LRUPolicy
from kvmesh.engine.protocol import (
    DEFAULT_HASH_ROOT,
    NO_EXTRA,
    RESIDENCY_SAMPLE,
    BlockExtra,
    HashAlgo,
    KVEvent,
    block_hashes,
)


@dataclass
class Block:
    """One block of KV storage. `block_hash` is set once the block is full and registered in the cache."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None  # the hash before it in its chain (the root for a first block)
    hits: int = 0  # admissions that reused it since it was registered: how hot its prefix is
    stored_at: float = 0.0  # residency times, kept for sampled blocks only
    idle_since: float = 0.0


class ResidencySampling:
    """Residency observations (RESIDENCY_KINDS) of one block in RESIDENCY_SAMPLE, chosen by hash so every tier
    samples the same blocks: the one home of the sampling rule for the device pool (BlockPool) and the host and
    disk tiers (engine/kv/tiers.py). Nothing is observed until `on_residency` is set."""

    on_residency: Callable[[str, float], None] | None = None  # (kind, seconds): the residency histograms

    def _sampled(self, block_hash: int | None) -> bool:
        return self.on_residency is not None and block_hash is not None and block_hash % RESIDENCY_SAMPLE == 0

    def _observe_eviction(self, block_hash: int | None, stored_at: float, idle_since: float) -> None:
        """A block leaves its tier: how long it was stored there, and how long unused before it went."""
        if self._sampled(block_hash):
            now = time.monotonic()
            self._observe("lifetime", now - stored_at)
            self._observe("idle", now - idle_since)

    def _observe_reuse(self, block_hash: int | None, idle_since: float) -> None:
        """A request uses a block again: how long it sat unused."""
        if self._sampled(block_hash):
            self._observe("reuse_gap", time.monotonic() - idle_since)

    def _observe(self, kind: str, seconds: float) -> None:
        assert self.on_residency is not None
        self.on_residency(kind, seconds)


@dataclass(frozen=True)
class KVStats:
    """An immutable snapshot of the pool, published after each step so a scrape always sees a consistent one."""

    total: int
    used: int
    evictable: int
    free: int
    block_size: int

    @property
    def usage(self) -> float:
        """vLLM's usage: blocks held by requests over all blocks. Evictable blocks count as free."""
        return self.used / self.total if self.total else 0.0


class BlockPool(ResidencySampling):
    """Fixed-size pool of blocks with reference counts and a hash -> block map of cached full blocks.

    A block is in exactly one state: used (ref_count > 0), evictable (ref_count 0, hashed, known to the
    policy) or free (ref_count 0, unhashed). Allocation takes free blocks first, then evicts.
    """

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy | None = None,
        on_event: Callable[[KVEvent], None] | None = None,
        tier: str = "device",
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: lowest ids first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.policy = policy if policy is not None else LRUPolicy()
        self._on_event = on_event
        self.tier = tier
        self.evictions = 0
        # called with the ids of blocks about to be handed out, so a copy still reading one (to a lower tier)
        # can finish before the block is overwritten
        self.before_reuse: Callable[[Sequence[int]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take now: free plus evictable."""
        return len(self._free) + len(self.policy)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take without evicting a cached one."""
        return len(self._free)

    def counts(self) -> tuple[int, int, int]:
        """(used, evictable, free)."""
        evictable = len(self.policy)
        free = len(self._free)
        return self.num_blocks - evictable - free, evictable, free

    def lookup(self, block_hash: int) -> Block | None:
        block_id = self._cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def touch(self, blocks: Sequence[Block]) -> None:
        """Take a reference on cached blocks (a prefix hit); evictable ones become used."""
        for block in blocks:
            if block.ref_count == 0:
                self.policy.remove(block.block_id)
                self._observe_reuse(block.block_hash, block.idle_since)
            block.ref_count += 1

    def allocate(self, n: int) -> list[Block]:
        """Take `n` blocks, evicting cached ones when no free block is left; raises if fewer are available."""
        if n > self.num_available:
            raise MemoryError(f"asked for {n} KV blocks, {self.num_available} available")
        taken: list[Block] = []
        evicted: list[int] = []
        for _ in range(n):
            if self._free:
                block = self.blocks[self._free.pop()]
            else:
                block = self.blocks[self.policy.pop_victim()]
                assert block.block_hash is not None
                del self._cached[block.block_hash]
                evicted.append(block.block_hash)
                self._observe_eviction(block.block_hash, block.stored_at, block.idle_since)
                block.block_hash = None
            block.ref_count = 1
            taken.append(block)
        if self.before_reuse is not None:
            self.before_reuse([b.block_id for b in taken])
        if evicted:
            self.evictions += len(evicted)
            self._emit(KVEvent("removed", tuple(evicted), tier=self.tier))
        return taken

    def register(self, block: Block, block_hash: int, parent_hash: int | None, token_count: int) -> bool:
        """Make a full block findable by its hash. Returns False when another block already holds that hash
        (two requests computed the same content at once): the duplicate stays private and is freed normally."""
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.hits = 0
        self._cached[block_hash] = block.block_id
        if self._sampled(block_hash):
            block.stored_at = time.monotonic()
        self._emit(KVEvent("stored", (block_hash,), tier=self.tier, parent_hash=parent_hash, token_count=token_count))
        return True

    def release(self, blocks: Sequence[Block], workload: str = "") -> None:
        """Drop one reference from each block, tail first, so a request's deepest blocks are evicted first.
        The policy learns the `workload` class that held them and each block's offset in the table."""
        for offset in range(len(blocks) - 1, -1, -1):
            block = blocks[offset]
            if block.ref_count <= 0:
                raise AssertionError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.append(block.block_id)
                else:
                    self.policy.add(block.block_id, BlockUse(workload, offset, block.block_hash))
                    if self._sampled(block.block_hash):
                        block.idle_since = time.monotonic()

    def clear(self) -> int:
        """Forget every evictable cached block (the pool's "reset prefix cache"); used blocks stay."""
        dropped: list[int] = []
        while len(self.policy):
            block = self.blocks[self.policy.pop_victim()]
            assert block.block_hash is not None
            del self._cached[block.block_hash]
            block.block_hash = None
            self._free.append(block.block_id)
            dropped.append(block.block_id)
        if dropped:
            self._emit(KVEvent("cleared", tier=self.tier))
        return len(dropped)

    def check_invariants(self) -> None:
        """Every block in exactly one state; the hash map and the blocks agree. Raises AssertionError."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in self.blocks:
            in_policy = block.block_id in self.policy
            if block.ref_count > 0:
                assert not in_policy and block.block_id not in free, f"used block {block.block_id} also listed free"
            elif block.block_hash is None:
                assert block.block_id in free and not in_policy, f"unhashed idle block {block.block_id} not free"
            else:
                assert in_policy and block.block_id not in free, f"idle cached block {block.block_id} not evictable"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, "hash map disagrees with block"
        assert len(self._cached) == sum(b.block_hash is not None for b in self.blocks)

    def _emit(self, event: KVEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)


@dataclass
class SequenceBlocks:
    """One request's block table and the hashes of its full blocks so far."""

    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    num_registered: int = 0  # leading blocks already registered in (or found in) the cache


@dataclass(frozen=True)
class HotChain:
    """A hot cached prefix: its block hashes from the root, and how many admissions reused its last block."""

    hashes: list[int]
    hits: int


@dataclass(frozen=True)
class PrefixHit:
    """The cached prefix found for a request at admission."""

    blocks: list[Block]
    num_tokens: int

    def capped(self, max_tokens: int | None) -> PrefixHit:
        """The hit cut to whole blocks within `max_tokens` (None: as it is)."""
        if max_tokens is None or self.num_tokens <= max_tokens:
            return self
        block_size = self.num_tokens // len(self.blocks)
        kept = self.blocks[: max_tokens // block_size]
        return PrefixHit(kept, len(kept) * block_size)


class KVCacheManager:
    """Block tables per request on top of a BlockPool, with chained prefix hashing (docs/contracts.md, contract 1)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_algo: HashAlgo = HashAlgo.XXH3,
        hash_root: int = DEFAULT_HASH_ROOT,
        policy: EvictionPolicy | None = None,
        on_event: Callable[[KVEvent], None] | None = None,
        enable_prefix_cache: bool = True,
    ) -> None:
        self.block_size = block_size
        self.hash_algo = hash_algo
        self.hash_root = hash_root
        self.enable_prefix_cache = enable_prefix_cache
        self.pool = BlockPool(num_blocks, policy, on_event)
        self.seqs: dict[str, SequenceBlocks] = {}

    def stats(self) -> KVStats:
        used, evictable, free = self.pool.counts()
        return KVStats(self.pool.num_blocks, used, evictable, free, self.block_size)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, seq_id: str, token_ids: Sequence[int], extra: BlockExtra) -> list[int]:
        seq = self.seqs.setdefault(seq_id, SequenceBlocks())
        full = len(token_ids) // self.block_size
        if len(seq.hashes) < full:
            parent = seq.hashes[-1] if seq.hashes else None
            seq.hashes += block_hashes(
                token_ids[: full * self.block_size],
                self.block_size,
                extra,
                self.hash_algo,
                self.hash_root,
                start=len(seq.hashes),
                parent=parent,
            )
        return seq.hashes

    def prefix_hashes(self, seq_id: str, token_ids: Sequence[int], extra: BlockExtra = NO_EXTRA) -> list[int]:
        """The hashes of the blocks a prefix hit may cover: every full block but one token's worth, so a
        request always computes at least one token."""
        return self._hashes(seq_id, token_ids, extra)[: (len(token_ids) - 1) // self.block_size]

    def find_prefix(self, seq_id: str, token_ids: Sequence[int], extra: BlockExtra = NO_EXTRA) -> PrefixHit:
        """The longest cached prefix of `token_ids`, leaving at least one token to compute (so the request
        gets logits). Takes no reference; `allocate` does."""
        if not self.enable_prefix_cache:
            return PrefixHit([], 0)
        hashes = self._hashes(seq_id, token_ids, extra)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hit: list[Block] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return PrefixHit(hit, len(hit) * self.block_size)

    def can_allocate(self, seq_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Whether the table of `seq_id` can grow to cover `num_tokens` tokens."""
        return self._new_blocks_needed(seq_id, num_tokens, hit) <= self.pool.num_available

    def _new_blocks_needed(self, seq_id: str, num_tokens: int, hit: PrefixHit | None) -> int:
        seq = self.seqs.get(seq_id)
        have = len(seq.blocks) if seq else 0
        need = self.blocks_for(num_tokens) - have
        if hit is not None and hit.blocks:
            need -= len(hit.blocks)
            # hit blocks that are evictable now stop being available once referenced
            need += sum(1 for b in hit.blocks if b.ref_count == 0)
        return max(need, 0)

    def free_capacity(self, seq_id: str) -> int:
        """Tokens the table of `seq_id` can cover taking free blocks only, evicting no cached one (the room for
        optional work such as speculative drafts)."""
        seq = self.seqs.get(seq_id)
        return ((len(seq.blocks) if seq else 0) + self.pool.num_free) * self.block_size

    def allocate(self, seq_id: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grow the table of `seq_id` to cover `num_tokens` tokens, first taking the prefix `hit` (at
        admission). Returns False, changing nothing, when the pool cannot supply the blocks."""
        if not self.can_allocate(seq_id, num_tokens, hit):
            return False
        seq = self.seqs.setdefault(seq_id, SequenceBlocks())
        if hit is not None and hit.blocks:
            assert not seq.blocks, "a prefix hit is taken only by a request holding no blocks"
            self.pool.touch(hit.blocks)
            for block in hit.blocks:
                block.hits += 1
            seq.blocks.extend(hit.blocks)
            seq.num_registered = len(hit.blocks)
        missing = self.blocks_for(num_tokens) - len(seq.blocks)
        if missing > 0:
            seq.blocks.extend(self.pool.allocate(missing))
        return True

    def fills_block(self, seq_id: str, num_computed: int) -> bool:
        """Whether `commit` with `num_computed` tokens would register a block (so a caller builds the token list
        only then)."""
        seq = self.seqs[seq_id]
        return self.enable_prefix_cache and min(num_computed // self.block_size, len(seq.blocks)) > seq.num_registered

    def commit(
        self, seq_id: str, token_ids: Sequence[int], num_computed: int, extra: BlockExtra = NO_EXTRA
    ) -> None:
        """Register the blocks that `num_computed` computed tokens have filled, so later requests find them."""
        if not self.enable_prefix_cache:
            return
        seq = self.seqs[seq_id]
        full = min(num_computed // self.block_size, len(seq.blocks))
        if full <= seq.num_registered:
            return
        hashes = self._hashes(seq_id, token_ids[: full * self.block_size], extra)
        for i in range(seq.num_registered, full):
            parent = hashes[i - 1] if i else self.hash_root
            self.pool.register(seq.blocks[i], hashes[i], parent, self.block_size)
        seq.num_registered = full

    def hot_chains(self, limit: int) -> list[HotChain]:
        """The `limit` hottest cached prefixes, hottest first (the longer of equals first): one chain per reused
        block that no other reused block extends (its ancestors were reused at least as often, so the chain
        carries them). A chain whose ancestor was evicted cannot be named from the root and is left out."""
        reused = [b for b in self.pool.blocks if b.block_hash is not None and b.hits]
        extended = {b.parent_hash for b in reused}
        chains = [HotChain(hashes, tip.hits) for tip in reused if tip.block_hash not in extended
                  if (hashes := self._chain_to(tip)) is not None]
        chains.sort(key=lambda c: (-c.hits, -len(c.hashes)))
        return chains[:limit]

    def _chain_to(self, block: Block) -> list[int] | None:
        """The hashes from the root to `block`, or None if a cached ancestor is missing."""
        assert block.block_hash is not None
        chain = [block.block_hash]
        parent = block.parent_hash
        while parent != self.hash_root:
            ancestor = None if parent is None else self.pool.lookup(parent)
            if ancestor is None or len(chain) > self.pool.num_blocks:
                return None
            chain.append(parent)
            parent = ancestor.parent_hash
        chain.reverse()
        return chain

    def pin_cached(self, key: str, hashes: Sequence[int]) -> list[int]:
        """Take a reference, under `key`, on the longest cached prefix of `hashes` (blocks being sent to a peer
        must not be evicted and overwritten mid-copy). Returns their block ids; `free(key)` lets them go."""
        found: list[Block] = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            found.append(block)
        self.pool.touch(found)
        self.seqs.setdefault(key, SequenceBlocks()).blocks.extend(found)
        return [b.block_id for b in found]

    def allocate_unregistered(self, key: str, n: int) -> list[int] | None:
        """`n` fresh blocks held under `key`, to be filled from outside (a peer's KV) and then registered with
        `register_filled`. None when the pool cannot spare them."""
        if n > self.pool.num_available:
            return None
        blocks = self.pool.allocate(n)
        self.seqs.setdefault(key, SequenceBlocks()).blocks.extend(blocks)
        return [b.block_id for b in blocks]

    def register_filled(self, block_ids: Sequence[int], hashes: Sequence[int], parent: int | None) -> int:
        """Register filled blocks under their chained hashes (parent first); returns how many became findable.
        A hash another block already holds stays with that block."""
        registered = 0
        for block_id, block_hash in zip(block_ids, hashes, strict=True):
            block = self.pool.blocks[block_id]
            registered += self.pool.register(block, block_hash, self.hash_root if parent is None else parent,
                                             self.block_size)
            parent = block_hash
        return registered

    def rename(self, seq_id: str, key: str) -> None:
        """Hand a sequence's blocks to another holder (a finished prefill's blocks to its transfer handle)."""
        if seq_id in self.seqs:
            self.seqs.setdefault(key, SequenceBlocks()).blocks.extend(self.seqs.pop(seq_id).blocks)

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.seqs[seq_id].blocks]

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Shrink a table to the blocks its first `num_tokens` tokens fill (the slots of rejected speculative
        drafts go back). Only tokens a request verified are ever committed, so a dropped block is never
        registered, cached or published: it goes straight back to the free list."""
        seq = self.seqs[seq_id]
        keep = self.blocks_for(num_tokens)
        dropped = seq.blocks[keep:]
        if not dropped:
            return
        assert keep >= seq.num_registered, "truncating into registered blocks"
        assert all(b.block_hash is None and b.ref_count == 1 for b in dropped), "a dropped draft block is shared"
        del seq.blocks[keep:]
        self.pool.release(dropped)

    def free(self, seq_id: str, workload: str = "") -> None:
        """Release a request's blocks: registered ones stay cached (evictable, filed under the request's
        `workload` class for the eviction policy), the rest become free."""
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.release(seq.blocks, workload)

    def check_invariants(self) -> None:
        """Pool invariants plus: reference counts equal the number of tables holding each block."""
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        for seq in self.seqs.values():
            for block in seq.blocks:
                refs[block.block_id] += 1
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, held by {refs[block.block_id]} tables"
            )
