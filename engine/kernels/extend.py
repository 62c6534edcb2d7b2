"""Extend (prefill with a cached prefix) attention over the block-first KV layout, ragged batches.

Each sequence computes `q_len` new tokens after `context_len - q_len` cached ones. Its new K/V are already in
the cache (the KV write runs first), so a query at position p reads every key at positions <= p through the
block table: the cached prefix in full and the new tokens causally, in one loop. Work is cut into tiles of
BLOCK_M queries of one sequence, listed on the host, so a batch of one long prompt and many short ones
launches no idle programs.
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
    next_pow2,
    online_softmax_step,
    scale_arguments,
)

LOG2E = 1.4426950408889634
BLOCK_M = 64  # queries a program takes
BLOCK_N = 64  # keys a loop step reads


@dataclass(frozen=True)
class ExtendBatch:
    """A step's multi-token sequences: built once per step on the host, used by every layer."""

    q_starts: torch.Tensor  # [S] int32: the row of each sequence's first new token in q and out
    q_lens: torch.Tensor  # [S] int32
    context_lens: torch.Tensor  # [S] int32: cached prefix + new tokens
    block_tables: torch.Tensor  # [S, W] int32, padded with any valid block id
    tile_seqs: torch.Tensor  # [tiles] int32: the sequence a tile belongs to
    tile_starts: torch.Tensor  # [tiles] int32: the tile's first query, counted within its sequence

    @classmethod
    def build(
        cls,
        q_starts: list[int],
        q_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        device: torch.device,
    ) -> ExtendBatch:
        if not (len(q_starts) == len(q_lens) == len(context_lens) == len(block_tables)) or not q_starts:
            raise ValueError("an extend batch needs one start, length, context and block table per sequence")
        if any(n < 1 or c < n for n, c in zip(q_lens, context_lens, strict=True)):
            raise ValueError("each sequence needs 1 <= q_len <= context_len")
        width = max(len(t) for t in block_tables)
        padded = [t + [t[0]] * (width - len(t)) for t in block_tables]
        tiles = [(s, m) for s, n in enumerate(q_lens) for m in range(0, n, BLOCK_M)]

        def as_tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return cls(
            as_tensor(q_starts),
            as_tensor(q_lens),
            as_tensor(context_lens),
            as_tensor(padded),
            as_tensor([s for s, _ in tiles]),
            as_tensor([m for _, m in tiles]),
        )


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr,
    q_starts_ptr, q_lens_ptr, lens_ptr, tables_ptr, tile_seqs_ptr, tile_starts_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_vsb, stride_vst,
    stride_ot, stride_oh,
    stride_tb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seqs_ptr + tile)
    m0 = tl.load(tile_starts_ptr + tile)
    q_start = tl.load(q_starts_ptr + seq).to(tl.int64)
    q_len = tl.load(q_lens_ptr + seq)
    context_len = tl.load(lens_ptr + seq)
    prefix = context_len - q_len
    m = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    m_ok = m < q_len
    d_ok = d < HEAD_DIM
    q_pos = prefix + m  # absolute positions of this tile's queries

    rows = q_start + m.to(tl.int64)
    q_off = rows[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q = (q * scale_log2).to(DOT)
    table = tables_ptr + seq.to(tl.int64) * stride_tb

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(context_len, prefix + m0 + BLOCK_M)  # the tile's last query sees no further
    for tok0 in range(0, end, BLOCK_N):
        tok = tok0 + n
        tok_ok = tok < end
        k, v = load_kv_tile(table, k_ptr, v_ptr, ks_ptr, vs_ptr, tok, tok_ok, d, d_ok, kv_head,
                            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                            stride_ksb, stride_kst, stride_vsb, stride_vst, PAGE, DOT, QUANT)
        visible = tok_ok[None, :] & (tok[None, :] <= q_pos[:, None])  # key 0 is visible to every query
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, DOT, PRECISION)

    o_off = rows[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ExtendBatch,
    scale: float,
    out: torch.Tensor | None = None,
    scales: Scales | None = None,
) -> torch.Tensor:
    """Attend each sequence's new rows of q ([T, Hq, D]) over its cached prefix and, causally, its new tokens;
    writes those rows of `out` (allocated like q when None) and returns it. k_cache and v_cache are one
    layer's views of the block-first cache, [num_blocks, block_size, Hkv, D]: in the model's dtype, or int8
    with their `scales`."""
    q_heads, head_dim, page, kv_heads = attention_layout(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    ks, vs, stride_ksb, stride_kst, stride_vsb, stride_vst, quant = scale_arguments(scales, k_cache)
    _extend_kernel[(batch.tile_seqs.shape[0], q_heads)](
        q, k_cache, v_cache, ks, vs, out,
        batch.q_starts, batch.q_lens, batch.context_lens, batch.block_tables, batch.tile_seqs, batch.tile_starts,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_ksb, stride_kst, stride_vsb, stride_vst,
        out.stride(0), out.stride(1),
        batch.block_tables.stride(0),
        GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_M=BLOCK_M, BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_N=BLOCK_N,
        DOT=dot_dtype(q.dtype), PRECISION=dot_precision(q.dtype), QUANT=quant,
    )
    LAUNCHES["extend"] += 1
    return out
