"""Paged decode attention: one query token per sequence over its block table, on the block-first KV layout.

One program takes one (sequence, KV head, split) and all the query heads that share that KV head (GQA), so K
and V are read once per group, not once per query head. A long context is cut into `num_splits` segments
computed by separate programs ("flash-decoding"); each writes its normalized partial output and log-sum-exp,
and a second small kernel merges them. Without splits a batch of one long sequence would run on a handful of
programs and leave most of a GPU idle. The split count is a runtime argument, not a compile-time constant, so a
serving engine does not compile a new kernel variant for every count it meets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    LAUNCHES,
    Scales,
    attention_layout,
    dot_dtype,
    dot_precision,
    load_kv_tile,
    multiprocessors,
    next_pow2,
    online_softmax_step,
    scale_arguments,
)

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in merging than it gains in parallelism


@dataclass(frozen=True)
class DecodeLaunch:
    """The shape of a decode launch, apart from what the batch fixes. The defaults are what the engine runs;
    the benchmark (measure.py) times alternatives on a GPU, so a measured choice can replace them without
    guessing: the kernel is memory-bound and its speed depends on how many loads each multiprocessor keeps in
    flight, which only the card can tell."""

    block_n: int = 64  # context tokens a loop step reads
    num_warps: int = 4
    num_stages: int = 3  # software pipelining: the next steps' block ids and K/V load while this step computes
    waves: int = 2  # splits aim for (sequences x KV heads x splits) = waves x multiprocessors

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1) or self.num_stages < 1 or self.waves < 1:
            raise ValueError(f"num_warps must be a power of two, num_stages and waves >= 1: {self}")


DEFAULT_LAUNCH = DecodeLaunch()


@dataclass(frozen=True)
class DecodeBatch:
    """A step's decoding sequences: built once per step on the host, used by every layer."""

    rows: torch.Tensor  # [B] int32: the row of each sequence's query in q and out
    block_tables: torch.Tensor  # [B, W] int32, padded with any valid block id
    context_lens: torch.Tensor  # [B] int32, including the token being decoded (its K/V already written)
    max_context_len: int

    @classmethod
    def build(
        cls, rows: list[int], block_tables: list[list[int]], context_lens: list[int], device: torch.device
    ) -> DecodeBatch:
        if not (len(rows) == len(block_tables) == len(context_lens)) or not rows:
            raise ValueError("a decode batch needs one row, block table and context length per sequence")
        if min(context_lens) < 1:
            raise ValueError("every decoding sequence attends to at least its own token")
        width = max(len(t) for t in block_tables)
        padded = [t + [t[0]] * (width - len(t)) for t in block_tables]
        return cls(
            torch.tensor(rows, dtype=torch.int32, device=device),
            torch.tensor(padded, dtype=torch.int32, device=device),
            torch.tensor(context_lens, dtype=torch.int32, device=device),
            max(context_lens),
        )


def choose_splits(batch_size: int, kv_heads: int, max_context_len: int, device: torch.device,
                  waves: int = DEFAULT_LAUNCH.waves) -> int:
    """Enough splits that (sequences x KV heads x splits) fills the device `waves` times over, none shorter
    than MIN_SPLIT_TOKENS."""
    programs = batch_size * kv_heads
    wanted = triton.cdiv(waves * multiprocessors(device), programs)
    return max(1, min(wanted, triton.cdiv(max_context_len, MIN_SPLIT_TOKENS)))


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    rows_ptr, tables_ptr, lens_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_vsb, stride_vst,
    stride_ot, stride_oh,
    stride_tb,
    split_len, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    row = tl.load(rows_ptr + seq).to(tl.int64)
    context_len = tl.load(lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    q_off = row * stride_qt + heads[:, None].to(tl.int64) * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q = (q * scale_log2).to(DOT)  # scores come out in log2 units: exp2 instead of exp
    table = tables_ptr + seq.to(tl.int64) * stride_tb

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tok0 in range(start, end, BLOCK_N):
        tok = tok0 + n
        tok_ok = tok < end  # every step holds at least one valid token
        k, v = load_kv_tile(table, k_ptr, v_ptr, ks_ptr, vs_ptr, tok, tok_ok, d, d_ok, kv_head,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                            stride_ksb, stride_kst, stride_vsb, stride_vst, PAGE, DOT, QUANT)
        m_i, l_i, acc = online_softmax_step(q, k, v, tok_ok[None, :], m_i, l_i, acc, DOT, PRECISION)

    out_mask = g_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        o_off = row * stride_ot + heads[:, None].to(tl.int64) * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: [B, Hq, num_splits, D] and [B, Hq, num_splits]; an empty split stores lse = -inf
        empty = l_i == 0.0
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        base = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads.to(tl.int64)) * num_splits + split
        tl.store(part_lse_ptr + base, lse, mask=g_ok)
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM + d[None, :], o, mask=out_mask)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, rows_ptr,
    stride_ot, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    d_ok = d < HEAD_DIM
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # the first split is never empty, so the max is finite
    o = tl.load(part_out_ptr + (base + s[:, None]) * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                other=0.0)
    merged = tl.sum(o * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    row = tl.load(rows_ptr + seq).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, merged.to(out_ptr.dtype.element_ty), mask=d_ok)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    launch: DecodeLaunch = DEFAULT_LAUNCH,
    scales: Scales | None = None,
) -> torch.Tensor:
    """Attend q[batch.rows] ([T, Hq, D]) over each sequence's cached context; writes those rows of `out`
    ([T, Hq, D], allocated like q when None) and returns it. k_cache and v_cache are one layer's views of the
    block-first cache, [num_blocks, block_size, Hkv, D] with any block stride (`kv[:, layer, 0]`): in the
    model's dtype, or int8 with their `scales`."""
    q_heads, head_dim, page, kv_heads = attention_layout(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    size = batch.rows.shape[0]
    splits = num_splits or choose_splits(size, kv_heads, batch.max_context_len, q.device, launch.waves)
    split_len = triton.cdiv(triton.cdiv(batch.max_context_len, splits), launch.block_n) * launch.block_n
    group = q_heads // kv_heads
    if splits > 1:
        part_out = torch.empty((size, q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((size, q_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    ks, vs, stride_ksb, stride_kst, stride_vsb, stride_vst, quant = scale_arguments(scales, k_cache)
    _decode_kernel[(size, kv_heads, splits)](
        q, k_cache, v_cache, ks, vs, out, part_out, part_lse,
        batch.rows, batch.block_tables, batch.context_lens,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_ksb, stride_kst, stride_vsb, stride_vst,
        out.stride(0), out.stride(1),
        batch.block_tables.stride(0),
        split_len, splits,
        GROUP=group, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_N=launch.block_n,
        SPLIT=splits > 1, DOT=dot_dtype(q.dtype), PRECISION=dot_precision(q.dtype), QUANT=quant,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    LAUNCHES["decode"] += 1
    if splits > 1:
        _merge_kernel[(size, q_heads)](
            part_out, part_lse, out, batch.rows, out.stride(0), out.stride(1), splits,
            HEAD_DIM=head_dim, BLOCK_S=next_pow2(splits), BLOCK_D=next_pow2(head_dim),
        )
        LAUNCHES["decode_merge"] += 1
    return out
