"""Shared-prefix ("cascade") decode attention on the torch path: which sequences are grouped, and that the
grouped computation (prefix once per group, suffixes apart, merged by log-sum-exp) gives the plain path's
output, down to an engine generating the same tokens with and without it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvmesh.engine import runner as runner_module
from kvmesh.engine.attention import (
    CASCADE_MIN_SAVED_BLOCKS,
    TorchMetadata,
    build_metadata,
    paged_attention,
    plan_cascade,
    shareable_blocks,
)
from kvmesh.engine.kvcache import KVLayout, LayerKV

from .conftest import make_engine
from .test_engine import generate, prompt

BLOCK = 16
NUM_BLOCKS = 4000
CPU = torch.device("cpu")


def layer(cache: torch.Tensor, index: int) -> tuple[LayerKV, LayerKV]:
    """One layer's K and V of a cache in the model's dtype (`[blocks, layers, 2, block, heads, dim]`)."""
    return LayerKV(cache[:, index, 0]), LayerKV(cache[:, index, 1])


def test_distinct_prefixes_make_distinct_groups() -> None:
    a, b = list(range(100, 112)), list(range(200, 212))
    tables = [[*a, 1], [*b, 2], [*a, 3], [*b, 4], [*a, 5], [50, 51, 52]]
    groups = plan_cascade(tables, [len(t) - 1 for t in tables], min_saved=8)
    assert sorted((sorted(g), n) for g, n in groups) == [([0, 2, 4], 12), ([1, 3], 12)]


def test_a_longer_shared_run_splits_off_when_it_saves_more() -> None:
    base = list(range(100, 105))
    long = [*base, *range(300, 315)]  # A and B share 20 blocks; C and D share only the first 5 with them
    tables = [[*long, 1], [*base, 7, 1], [*long, 2], [*base, 8, 2]]
    shareable = [len(t) - 1 for t in tables]
    # all four together would save 3 x 5 = 15; A+B save 20, C+D 5 (less than 8: left plain)
    assert plan_cascade(tables, shareable, min_saved=8) == [([0, 2], 20)]
    assert sorted(plan_cascade(tables, shareable, min_saved=0)) == [([0, 2], 20), ([1, 3], 5)]


def test_a_group_must_save_more_than_its_fixed_cost() -> None:
    pair = [[1, 2, 3, 4, 10], [1, 2, 3, 4, 11]]  # saves 4 block reads
    assert plan_cascade(pair, [4, 4], min_saved=5) == []
    assert plan_cascade([*pair, [1, 2, 3, 4, 12]], [4, 4, 4], min_saved=8) == [([0, 1, 2], 4)]


def test_the_block_a_token_is_written_to_is_never_shared() -> None:
    assert shareable_blocks(BLOCK * 3, BLOCK) == 2  # the new token is the last of block 3
    assert shareable_blocks(BLOCK * 3 + 1, BLOCK) == 3
    same = [[5, 6, 7], [5, 6, 7]]
    assert plan_cascade(same, [2, 2], min_saved=0) == [([0, 1], 2)]


def _step(rng: random.Random, groups: list[int], singles: int, prefix_blocks: int,
          suffix: str) -> list[tuple[list[int], int, int]]:
    """A step's (block table, computed, new) per sequence in shuffled order: `groups` members sharing a group's
    prefix of distinct random blocks, `singles` sharing nothing, and one prefilling sequence. Suffix "one":
    each member's new token is the first after the prefix; "blocks": 1 to 4 blocks more."""
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    seqs: list[tuple[list[int], int, int]] = []
    for members in groups:
        prefix = [free.pop() for _ in range(prefix_blocks)]
        for _ in range(members):
            extra = 1 if suffix == "one" else rng.randint(BLOCK + 1, 4 * BLOCK)
            context = prefix_blocks * BLOCK + extra
            seqs.append(([*prefix, *(free.pop() for _ in range(-(-extra // BLOCK)))], context - 1, 1))
    for _ in range(singles):
        context = rng.randint(1, 30 * BLOCK)
        seqs.append(([free.pop() for _ in range(-(-context // BLOCK))], context - 1, 1))
    rng.shuffle(seqs)
    computed, new = 3 * BLOCK + 5, 9  # a prefill on a cached prefix, in the middle of the batch
    seqs.insert(len(seqs) // 2, ([free.pop() for _ in range(-(-(computed + new) // BLOCK))], computed, new))
    return seqs


@pytest.mark.parametrize("suffix", ["one", "blocks"])
@pytest.mark.parametrize("per_kv", [1, 3])
@pytest.mark.parametrize("groups", [[], [4], [3, 2, 5]], ids=["no-group", "one-group", "three-groups"])
def test_cascade_equals_the_plain_path(groups: list[int], per_kv: int, suffix: str) -> None:
    rng = random.Random(f"{groups}-{per_kv}-{suffix}")
    torch.manual_seed(rng.randrange(1 << 30))
    seqs = _step(rng, groups, singles=3, prefix_blocks=CASCADE_MIN_SAVED_BLOCKS, suffix=suffix)
    kv_heads, dim = 2, 32
    cache = torch.randn(NUM_BLOCKS, 2, 2, BLOCK, kv_heads, dim)
    tokens = sum(n for _, _, n in seqs)
    q = torch.randn(tokens, kv_heads * per_kv, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    cascade = build_metadata(seqs, BLOCK, CPU, cascade=True)
    plain = build_metadata(seqs, BLOCK, CPU, cascade=False)
    assert isinstance(cascade, TorchMetadata) and isinstance(plain, TorchMetadata)
    assert sorted(g.rows.shape[0] for g in cascade.cascade_groups) == sorted(groups)
    assert plain.cascade_groups == []
    got = paged_attention(q, k, v, layer(cache.clone(), 1), cascade, dim**-0.5)
    want = paged_attention(q, k, v, layer(cache.clone(), 1), plain, dim**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_cascade_equals_the_plain_path_on_an_int8_cache() -> None:
    """Both paths read the same dequantized blocks, so they agree to fp32 rounding on an int8 cache too."""
    rng = random.Random(3)
    torch.manual_seed(3)
    seqs = _step(rng, [3, 2, 5], singles=3, prefix_blocks=CASCADE_MIN_SAVED_BLOCKS, suffix="blocks")
    layout = KVLayout(num_layers=1, block_size=BLOCK, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                      cache_dtype="int8")
    cache = layout.allocate(NUM_BLOCKS, CPU)
    blocks, offsets = torch.arange(NUM_BLOCKS).repeat_interleave(BLOCK), torch.arange(BLOCK).repeat(NUM_BLOCKS)
    for part in layout.layers(cache)[0]:
        part.write(blocks, offsets, torch.randn(NUM_BLOCKS * BLOCK, 2, 32))
    tokens = sum(n for _, _, n in seqs)
    q, k, v = torch.randn(tokens, 6, 32), torch.randn(tokens, 2, 32), torch.randn(tokens, 2, 32)
    cascade = build_metadata(seqs, BLOCK, CPU, cascade=True)
    assert isinstance(cascade, TorchMetadata) and len(cascade.cascade_groups) == 3  # the cascade really runs
    got = paged_attention(q, k, v, layout.layers(cache.clone())[0], cascade, 32**-0.5)
    want = paged_attention(q, k, v, layout.layers(cache.clone())[0], build_metadata(seqs, BLOCK, CPU, cascade=False),
                           32**-0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_cascade_in_bf16_stays_within_bf16_rounding() -> None:
    rng = random.Random(7)
    torch.manual_seed(7)
    seqs = _step(rng, [6], singles=1, prefix_blocks=16, suffix="blocks")
    cache = torch.randn(NUM_BLOCKS, 1, 2, BLOCK, 3, 64).bfloat16()
    tokens = sum(n for _, _, n in seqs)
    q, k, v = (torch.randn(tokens, h, 64).bfloat16() for h in (9, 3, 3))
    cascade = build_metadata(seqs, BLOCK, CPU, cascade=True)
    assert isinstance(cascade, TorchMetadata) and len(cascade.cascade_groups) == 1  # the cascade really runs
    got = paged_attention(q, k, v, layer(cache.clone(), 0), cascade, 0.125)
    want = paged_attention(q, k, v, layer(cache.clone(), 0), build_metadata(seqs, BLOCK, CPU, cascade=False), 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_an_engine_generates_the_same_tokens_with_and_without_cascade(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two system prompts, three requests each, all decoding together over their cached prompt blocks (three
    sharing 40 blocks save 80 block reads, 36 save 72: both groups pay). A spy on build_metadata (the real one,
    called through) checks the cascade really ran."""
    groups_seen: list[int] = []
    real = runner_module.build_metadata

    def spy(*args: object, **kwargs: object) -> object:
        meta = real(*args, **kwargs)  # type: ignore[arg-type]
        if isinstance(meta, TorchMetadata):
            groups_seen.append(len(meta.cascade_groups))
        return meta

    monkeypatch.setattr(runner_module, "build_metadata", spy)
    systems = [prompt(11, 40 * BLOCK), prompt(12, 36 * BLOCK)]
    prompts = [[*s, *prompt(20 + 3 * i + j, 5 + j)] for i, s in enumerate(systems) for j in range(3)]
    results = {}
    for cascade in (True, False):
        engine = make_engine(tiny_dir)
        engine.runner.cascade_attention = cascade
        generate(engine, [[*s, 7] for s in systems], max_tokens=1)  # the prefixes enter the cache
        groups_seen.clear()
        results[cascade] = generate(engine, prompts, max_tokens=12, logprobs=True)
        assert max(groups_seen) == (2 if cascade else 0)
        assert all(r.final.cached_tokens >= 36 * BLOCK for r in results[cascade])
    for on, off in zip(results[True], results[False], strict=True):
        assert on.tokens == off.tokens
        assert max(abs(a - b) for a, b in zip(on.logprobs, off.logprobs, strict=True)) < 1e-4
