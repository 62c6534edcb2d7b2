"""Every Triton kernel against its plain torch reference (gather the blocks, attend in fp32), run on the CPU by
Triton's interpreter: random cases (hypothesis, ten examples a property) and the edges (one token, exact block
multiples, permuted block tables, GQA 1/3/8, head sizes 64/128, one and many sequences, splits).

Tolerance, |kernel - reference| <= tol * (1 + |reference|), tol from reference.TOLERANCE: fp32 2e-5
(summation order only); fp16 3e-3 (probabilities enter the P.V product in fp16; outputs round at 2^-11);
bf16 2e-2 (outputs round at 2^-8). The interpreter multiplies bf16 in fp32 (kernels/common.py says why), so
bf16 cases check addressing, conversion and rounding; the bf16 tensor-core product is checked on a GPU by
`python engine/kernels/bench.py`. KV writes and block copies must be exact (a KV write that also converts
fp32 to bf16: within one bf16 ulp, because the interpreter truncates where the GPU rounds to nearest).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined: triton decides when a kernel is decorated

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.runtime.interpreter import InterpretedFunction

from kvmesh.engine.kernels import block_copy, decode, extend, gather_blocks, kv_write, scatter_blocks
from kvmesh.engine.kernels import reference as ref

assert isinstance(decode._decode_kernel, InterpretedFunction), (
    "kernel modules were imported before TRITON_INTERPRET=1 was set; they cannot run on this CPU"
)

TOLERANCE = ref.TOLERANCE
DTYPES = list(TOLERANCE)
# the same ten examples every run (stable CI time), and no .hypothesis folder in the tree
FEW = settings(max_examples=10, deadline=None, database=None, derandomize=True)
LAYERS = 2  # kernels read layer 1: a strided view, as in the engine


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def make_cache(blocks: int, page: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A block-first cache [blocks, layers, 2, page, Hkv, D] of random values."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((blocks, LAYERS, 2, page, kv_heads, head_dim), generator=g).to(dtype)


def tables_for(lengths: list[int], page: int, blocks: int, rng: random.Random) -> list[list[int]]:
    """Disjoint block tables in random (non-contiguous, permuted) order."""
    ids = list(range(blocks))
    rng.shuffle(ids)
    out = []
    for n in lengths:
        need = -(-n // page)
        out.append(ids[:need])
        ids = ids[need:]
    return out


def check_decode(
    lengths: list[int], kv_heads: int, group: int, head_dim: int, page: int, dtype: torch.dtype,
    splits: int | None, seed: int,
) -> None:
    rng = random.Random(seed)
    blocks = sum(-(-n // page) for n in lengths) + 3
    cache = make_cache(blocks, page, kv_heads, head_dim, dtype, seed)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    tables = tables_for(lengths, page, blocks, rng)
    rows = rng.sample(range(len(lengths) + 2), len(lengths))  # scattered rows of a flat batch
    q = torch.randn((len(lengths) + 2, kv_heads * group, head_dim), generator=torch.Generator().manual_seed(seed))
    q = q.to(dtype)
    scale = head_dim**-0.5
    batch = decode.DecodeBatch.build(rows, tables, lengths, q.device)
    out = decode.decode_attention(q, k_cache, v_cache, batch, scale, num_splits=splits)
    close(out[rows], ref.decode_reference(q, k_cache, v_cache, rows, tables, lengths, scale), dtype)


def check_extend(
    q_lens: list[int], prefixes: list[int], kv_heads: int, group: int, head_dim: int, page: int,
    dtype: torch.dtype, seed: int,
) -> None:
    rng = random.Random(seed)
    contexts = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    blocks = sum(-(-n // page) for n in contexts) + 2
    cache = make_cache(blocks, page, kv_heads, head_dim, dtype, seed)
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    tables = tables_for(contexts, page, blocks, rng)
    starts = [sum(q_lens[:i]) + i for i in range(len(q_lens))]  # one untouched row between sequences
    total = starts[-1] + q_lens[-1] + 1
    # q as a strided view of a fused projection, as the model hands it over
    fused = torch.randn((total, 2 * kv_heads * group * head_dim), generator=torch.Generator().manual_seed(seed))
    q = fused.to(dtype)[:, : kv_heads * group * head_dim].view(total, kv_heads * group, head_dim)
    scale = head_dim**-0.5
    batch = extend.ExtendBatch.build(starts, q_lens, contexts, tables, q.device)
    out = torch.zeros_like(q)
    extend.extend_attention(q, k_cache, v_cache, batch, scale, out=out)
    expected = ref.extend_reference(q, k_cache, v_cache, starts, q_lens, contexts, tables, scale)
    for start, n, want in zip(starts, q_lens, expected, strict=True):
        close(out[start : start + n], want, dtype)
    gaps = [s + n for s, n in zip(starts, q_lens, strict=True)]
    assert not out[gaps].any(), "rows of other sequences must be left alone"


# ---- decode ----------------------------------------------------------------------------------------------


@FEW
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=5),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3, 8]),
    head_dim=st.sampled_from([64, 128]),
    page=st.sampled_from([8, 16]),
    dtype=st.sampled_from(DTYPES),
    splits=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
def test_decode_matches_the_reference(
    lengths: list[int], kv_heads: int, group: int, head_dim: int, page: int, dtype: torch.dtype,
    splits: int | None, seed: int,
) -> None:
    check_decode(lengths, kv_heads, group, head_dim, page, dtype, splits, seed)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_gqa_ratios_and_head_sizes(group: int, head_dim: int) -> None:
    check_decode([1, 16, 77], 2, group, head_dim, 16, torch.float32, None, seed=group * head_dim)


def test_decode_single_token_and_exact_block_multiples() -> None:
    check_decode([1, 16, 32, 64, 128, 256], 1, 3, 64, 16, torch.float16, 2, seed=1)


@pytest.mark.parametrize("splits", [1, 2, 5, 8])
def test_decode_splits_merge_to_one_answer(splits: int) -> None:
    """One long sequence cut into segments (some of them empty for the short one) gives the unsplit answer."""
    check_decode([300, 3], 2, 4, 64, 16, torch.float32, splits, seed=7)


def test_decode_batch_of_many() -> None:
    rng = random.Random(3)
    check_decode([rng.randint(1, 40) for _ in range(24)], 1, 3, 64, 8, torch.bfloat16, None, seed=3)


def test_decode_rejects_a_batch_without_context() -> None:
    with pytest.raises(ValueError, match="at least its own token"):
        decode.DecodeBatch.build([0], [[1]], [0], torch.device("cpu"))


# ---- extend ----------------------------------------------------------------------------------------------


@FEW
@given(
    q_lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    prefix_seed=st.integers(0, 2**16),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3, 8]),
    head_dim=st.sampled_from([64, 128]),
    page=st.sampled_from([8, 16]),
    dtype=st.sampled_from(DTYPES),
)
def test_extend_matches_the_reference(
    q_lens: list[int], prefix_seed: int, kv_heads: int, group: int, head_dim: int, page: int, dtype: torch.dtype
) -> None:
    rng = random.Random(prefix_seed)
    prefixes = [rng.choice([0, rng.randint(1, 130), page * rng.randint(1, 8)]) for _ in q_lens]
    check_extend(q_lens, prefixes, kv_heads, group, head_dim, page, dtype, seed=prefix_seed)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_gqa_ratios_and_head_sizes(group: int, head_dim: int) -> None:
    check_extend([5, 20], [0, 37], 1, group, head_dim, 16, torch.float32, seed=group + head_dim)


def test_extend_edges_prefill_single_token_and_exact_multiples() -> None:
    """No prefix (plain prefill), one new token after a prefix, block-aligned prefix and prompt, and a prompt
    longer than one tile of queries, in one ragged launch."""
    check_extend([40, 1, 64, 130], [0, 50, 64, 16], 2, 3, 64, 16, torch.float16, seed=11)


def test_head_size_that_is_not_a_power_of_two() -> None:
    """Head size 80 (Phi-style) pads to 128 lanes and masks the rest."""
    check_decode([5, 40], 1, 2, 80, 16, torch.float32, 2, seed=13)
    check_extend([9, 3], [0, 20], 1, 2, 80, 16, torch.float16, seed=13)


def test_extend_ragged_batch_of_many() -> None:
    rng = random.Random(5)
    q_lens = [rng.randint(2, 12) for _ in range(12)]
    prefixes = [rng.randint(0, 40) for _ in q_lens]
    check_extend(q_lens, prefixes, 1, 2, 64, 8, torch.bfloat16, seed=5)


# ---- KV write ------------------------------------------------------------------------------------------


@FEW
@given(
    tokens=st.integers(1, 40),
    kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([16, 64, 128]),
    page=st.sampled_from([4, 16]),
    dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.float16, torch.float16),
                            (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]),
    seed=st.integers(0, 2**16),
)
def test_kv_write_matches_the_reference(
    tokens: int, kv_heads: int, head_dim: int, page: int, dtypes: tuple[torch.dtype, torch.dtype], seed: int
) -> None:
    """Each token lands in its slot (converted to the cache's dtype), slots of -1 are skipped, and nothing
    else in the cache changes."""
    src, dst = dtypes
    rng = random.Random(seed)
    blocks = tokens // page + 4
    slots = rng.sample(range(blocks * page), tokens)
    slots = [-1 if rng.random() < 0.2 else s for s in slots]
    cache = make_cache(blocks, page, kv_heads, head_dim, dst, seed)
    expected = cache.clone()
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn((tokens, 3, kv_heads, head_dim), generator=g).to(src)
    k, v = fused[:, 1], fused[:, 2]  # strided views, as the model's fused projection gives them
    slot_tensor = torch.tensor(slots, dtype=torch.int64)
    kv_write.write_kv(k, v, cache[:, 1, 0], cache[:, 1, 1], slot_tensor)
    ref.write_kv_reference(k, v, expected[:, 1, 0], expected[:, 1, 1], slot_tensor)
    if src == dst:
        assert torch.equal(cache, expected)
    else:  # the interpreter truncates fp32 -> bf16 where torch and the GPU round to nearest: one ulp apart
        torch.testing.assert_close(cache.float(), expected.float(), rtol=2**-7, atol=0)


def test_kv_write_rejects_mismatched_shapes() -> None:
    cache = make_cache(2, 4, 2, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="do not fit"):
        kv_write.write_kv(torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), cache[:, 0, 0], cache[:, 0, 1],
                          torch.zeros(3, dtype=torch.int64))


# ---- block copy ----------------------------------------------------------------------------------------


@FEW
@given(
    blocks=st.integers(2, 24),
    page=st.sampled_from([4, 16]),
    dtype=st.sampled_from([*DTYPES, torch.int8]),
    seed=st.integers(0, 2**16),
)
def test_block_gather_and_scatter_round_trip(blocks: int, page: int, dtype: torch.dtype, seed: int) -> None:
    """gather_blocks equals kv[ids] exactly, and scattering it into other blocks copies them exactly, touching
    nothing else. Block elements (2 x 2 x page x 3 x 40) are not a multiple of the copy tile."""
    rng = random.Random(seed)
    kv = (make_cache(blocks, page, 3, 40, torch.float32, seed) * 30).clamp(-120, 120).to(dtype)
    ids = rng.sample(range(blocks), rng.randint(1, blocks))
    id_tensor = torch.tensor(ids, dtype=rng.choice([torch.int32, torch.int64]))
    gathered = block_copy.gather_blocks_triton(kv, id_tensor)
    assert gathered.is_contiguous() and torch.equal(gathered, ref.gather_blocks_reference(kv, id_tensor))
    target = torch.zeros_like(kv)
    dest = torch.tensor(rng.sample(range(blocks), len(ids)))
    expected = target.clone()
    ref.scatter_blocks_reference(expected, dest, gathered)
    block_copy.scatter_blocks_triton(target, dest, gathered)
    assert torch.equal(target, expected)


def test_block_copy_dispatch_and_bad_input() -> None:
    """The public gather/scatter pick Triton when asked (always on CUDA) and torch otherwise, same answer."""
    kv = make_cache(6, 4, 2, 16, torch.float16, 1)
    ids = torch.tensor([4, 0, 2])
    before = block_copy.LAUNCHES["gather_blocks"]
    assert torch.equal(gather_blocks(kv, ids, backend="triton"), gather_blocks(kv, ids))
    assert block_copy.LAUNCHES["gather_blocks"] == before + 1
    a, b = torch.zeros_like(kv), torch.zeros_like(kv)
    scatter_blocks(a, ids, kv[:3], backend="triton")
    scatter_blocks(b, ids, kv[:3])
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="contiguous run"):
        block_copy.gather_blocks_triton(kv.transpose(1, 3), ids)
    with pytest.raises(ValueError, match="must be contiguous"):
        block_copy.scatter_blocks_triton(kv, ids, kv[:3].float())
    with pytest.raises(ValueError, match="backend"):
        gather_blocks(kv, ids, backend="cuda")
