"""Paged attention over the engine's KV layout, and the metadata a step needs to run it.

KV layout (block-first): one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`. All
layers of a block are one contiguous run, so offloading or handing a block to another pod is one copy
(docs/architecture.md says why). A layer's K is the strided view `cache[:, layer, 0]`, indexed by
(block id, offset) pairs.

This is the torch path (CPU, and the reference on GPU): new K/V are scattered into their slots, each
sequence's context is gathered through its block table, and SDPA does the rest. Decoding sequences share one
padded batched call; each prefilling sequence gets its own call with a causal mask shifted by its cached
prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """One sequence computing several tokens: rows [start, end) of the flat batch over `context_len` tokens."""

    start: int
    end: int
    block_table: torch.Tensor  # [blocks covering the context]
    context_len: int
    mask: torch.Tensor  # [n, context_len] bool, True where attended (causal, shifted by the cached prefix)


@dataclass
class AttentionMetadata:
    """Where a step's tokens write their K/V and what each sequence attends to."""

    slot_blocks: torch.Tensor  # [T] block of each new token
    slot_offsets: torch.Tensor  # [T] offset in that block
    decode_rows: torch.Tensor | None  # [B] flat-batch rows of single-token sequences
    decode_tables: torch.Tensor | None  # [B, max blocks] block tables, padded with block 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max blocks * block size] bool, True where attended
    prefills: list[PrefillSeq]


def build_metadata(
    seqs: list[tuple[list[int], int, int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Metadata for a step. `seqs` holds (block table, tokens already computed, new tokens) per sequence, in
    flat-batch order. Contexts are gathered a whole block at a time: one copy of block_size tokens instead of
    one per token."""
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillSeq] = []
    row = 0
    for table, computed, n in seqs:
        context_len = computed + n
        for pos in range(computed, context_len):
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
        used = table[: -(-context_len // block_size)]
        if n == 1:
            decode_rows.append(row)
            decode_tables.append(used)
            decode_lens.append(context_len)
        else:
            q_pos = torch.arange(computed, context_len, device=device)[:, None]
            k_pos = torch.arange(context_len, device=device)[None, :]
            prefills.append(PrefillSeq(row, row + n, torch.tensor(used, device=device), context_len, k_pos <= q_pos))
        row += n
    meta = AttentionMetadata(
        torch.tensor(slot_blocks, device=device),
        torch.tensor(slot_offsets, device=device),
        None,
        None,
        None,
        prefills,
    )
    if decode_rows:
        width = max(len(t) for t in decode_tables)
        lens = torch.tensor(decode_lens, device=device)
        meta.decode_rows = torch.tensor(decode_rows, device=device)
        meta.decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=device)
        positions = torch.arange(width * block_size, device=device)
        meta.decode_mask = (positions[None, :] < lens[:, None])[:, None, None, :]
    return meta


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's k, v ([T, Hkv, D]) into the cache, then attend q ([T, Hq, D]) over each context.
    Returns [T, Hq, D]."""
    k_cache = kv_cache[:, layer, 0]
    v_cache = kv_cache[:, layer, 1]
    k_cache[meta.slot_blocks, meta.slot_offsets] = k.to(kv_cache.dtype)
    v_cache[meta.slot_blocks, meta.slot_offsets] = v.to(kv_cache.dtype)
    out = torch.empty_like(q)
    _, _, _, block_size, heads, dim = kv_cache.shape
    if meta.decode_tables is not None:
        b, width = meta.decode_tables.shape
        # one copy a block: [B, blocks, bs, Hkv, D] is contiguous, so merging blocks and offsets is free
        flat = meta.decode_tables.view(-1)
        kd = k_cache.index_select(0, flat).view(b, width * block_size, heads, dim).transpose(1, 2).to(q.dtype)
        vd = v_cache.index_select(0, flat).view(b, width * block_size, heads, dim).transpose(1, 2).to(q.dtype)
        qd = q[meta.decode_rows][:, :, None, :]  # [B, Hq, 1, D]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[meta.decode_rows] = od[:, :, 0, :]
    for seq in meta.prefills:
        kp = k_cache.index_select(0, seq.block_table).view(-1, heads, dim)[: seq.context_len]
        vp = v_cache.index_select(0, seq.block_table).view(-1, heads, dim)[: seq.context_len]
        kp = kp.transpose(0, 1)[None].to(q.dtype)  # [1, Hkv, ctx, D]
        vp = vp.transpose(0, 1)[None].to(q.dtype)
        qp = q[seq.start : seq.end].transpose(0, 1)[None]  # [1, Hq, n, D]
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=seq.mask, scale=scale, enable_gqa=True)
        out[seq.start : seq.end] = op[0].transpose(0, 1)
    return out
