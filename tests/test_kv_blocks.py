"""The KV manager alone: block states, prefix lookup, reference counts, eviction order and events."""

from __future__ import annotations

import random

import pytest

from kvmesh.engine.kv.blocks import BlockPool, KVCacheManager
from kvmesh.engine.protocol import BlockExtra, KVEvent, block_hashes


def test_pool_states_always_sum_to_total() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    pool.register(a[0], 11, None, 16)
    pool.release(a)
    used, evictable, free = pool.counts()
    assert (used, evictable, free) == (0, 1, 7)
    pool.check_invariants()


def test_allocation_evicts_lru_and_reports_removed() -> None:
    events: list[KVEvent] = []
    pool = BlockPool(2, on_event=events.append)
    a, b = pool.allocate(1)[0], pool.allocate(1)[0]
    pool.register(a, 1, None, 16)
    pool.register(b, 2, None, 16)
    pool.release([a])
    pool.release([b])
    (c,) = pool.allocate(1)
    assert c is a and pool.lookup(1) is None and pool.lookup(2) is b
    assert [e.kind for e in events] == ["stored", "stored", "removed"] and events[-1].block_hashes == (1,)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.check_invariants()


def test_double_free_is_caught() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(AssertionError, match="double free"):
        pool.release(blocks)


def test_prefix_hit_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(16, 4)
    tokens = list(range(12))  # exactly 3 blocks
    assert kv.allocate("a", 12)
    kv.commit("a", tokens, 12)
    kv.free("a")
    hit = kv.find_prefix("b", tokens)
    assert hit.num_tokens == 8, "the last full block is not taken, so one token is computed"
    hit_longer = kv.find_prefix("c", [*tokens, 99])
    assert hit_longer.num_tokens == 12
    kv.check_invariants()


def test_shared_blocks_are_reference_counted() -> None:
    kv = KVCacheManager(8, 4)
    tokens = list(range(9))
    kv.allocate("a", 9)
    kv.commit("a", tokens, 9)
    hit = kv.find_prefix("b", tokens)
    assert hit.num_tokens == 8
    assert kv.allocate("b", 9, hit)
    assert kv.block_ids("a")[:2] == kv.block_ids("b")[:2]
    assert [kv.pool.blocks[i].ref_count for i in kv.block_ids("b")] == [2, 2, 1]
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    assert kv.stats().used == 0 and kv.stats().evictable == 2
    kv.check_invariants()


def test_salt_separates_tenants_and_hashes_match_protocol() -> None:
    kv = KVCacheManager(8, 4)
    tokens = list(range(9))
    kv.allocate("a", 9)
    kv.commit("a", tokens, 9, BlockExtra(cache_salt="tenant-a"))
    assert kv.find_prefix("b", tokens, BlockExtra(cache_salt="tenant-b")).num_tokens == 0
    assert kv.find_prefix("c", tokens, BlockExtra(cache_salt="tenant-a")).num_tokens == 8
    expected = block_hashes(tokens, 4, BlockExtra(cache_salt="tenant-a"))
    assert [kv.pool.blocks[i].block_hash for i in kv.block_ids("a")[:2]] == expected


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(4, 4)
    assert kv.allocate("a", 12)
    before = kv.stats()
    assert not kv.allocate("b", 8)
    assert kv.stats() == before
    kv.check_invariants()


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(7)
    kv = KVCacheManager(64, 4)
    live: dict[str, list[int]] = {}
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    for step in range(400):
        if live and (rng.random() < 0.4 or len(live) > 6):
            seq = rng.choice(sorted(live))
            kv.free(seq)
            del live[seq]
        else:
            seq = f"s{step}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            hit = kv.find_prefix(seq, tokens)
            if kv.allocate(seq, len(tokens), hit):
                kv.commit(seq, tokens, len(tokens))
                live[seq] = tokens
            else:
                kv.free(seq)
        kv.check_invariants()
        stats = kv.stats()
        assert stats.used + stats.evictable + stats.free == stats.total
