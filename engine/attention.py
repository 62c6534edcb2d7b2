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
    ctx_blocks: torch.Tensor  # [context_len] block id of every context position
    ctx_offsets: torch.Tensor  # [context_len]
    mask: torch.Tensor | None  # [n, context_len] bool, None when n == 1


@dataclass
class AttentionMetadata:
    """Where a step's tokens write their K/V and what each sequence attends to."""

    slot_blocks: torch.Tensor  # [T] block of each new token
    slot_offsets: torch.Tensor  # [T] offset in that block
    decode_rows: torch.Tensor | None  # [B] flat-batch rows of single-token sequences
    decode_blocks: torch.Tensor | None  # [B, L] padded context gather indices
    decode_offsets: torch.Tensor | None
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] bool, True where attended
    prefills: list[PrefillSeq]


def _gather_positions(block_table: list[int], context_len: int, block_size: int) -> tuple[list[int], list[int]]:
    blocks = [block_table[p // block_size] for p in range(context_len)]
    offsets = [p % block_size for p in range(context_len)]
    return blocks, offsets


def build_metadata(
    seqs: list[tuple[list[int], int, int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Metadata for a step. `seqs` holds (block table, tokens already computed, new tokens) per sequence, in
    flat-batch order."""
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    decode_rows: list[int] = []
    decode_ctx: list[tuple[list[int], list[int]]] = []
    prefills: list[PrefillSeq] = []
    row = 0
    for table, computed, n in seqs:
        context_len = computed + n
        for pos in range(computed, context_len):
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
        blocks, offsets = _gather_positions(table, context_len, block_size)
        if n == 1:
            decode_rows.append(row)
            decode_ctx.append((blocks, offsets))
        else:
            q_pos = torch.arange(computed, context_len, device=device)[:, None]
            k_pos = torch.arange(context_len, device=device)[None, :]
            prefills.append(
                PrefillSeq(
                    row,
                    row + n,
                    torch.tensor(blocks, device=device),
                    torch.tensor(offsets, device=device),
                    k_pos <= q_pos,
                )
            )
        row += n
    meta = AttentionMetadata(
        torch.tensor(slot_blocks, device=device),
        torch.tensor(slot_offsets, device=device),
        None,
        None,
        None,
        None,
        prefills,
    )
    if decode_rows:
        width = max(len(b) for b, _ in decode_ctx)
        pad_b = [b + [0] * (width - len(b)) for b, _ in decode_ctx]
        pad_o = [o + [0] * (width - len(o)) for _, o in decode_ctx]
        lens = torch.tensor([len(b) for b, _ in decode_ctx], device=device)
        meta.decode_rows = torch.tensor(decode_rows, device=device)
        meta.decode_blocks = torch.tensor(pad_b, device=device)
        meta.decode_offsets = torch.tensor(pad_o, device=device)
        meta.decode_mask = (torch.arange(width, device=device)[None, :] < lens[:, None])[:, None, None, :]
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
    if meta.decode_rows is not None:
        qd = q[meta.decode_rows][:, :, None, :]  # [B, Hq, 1, D]
        kd = k_cache[meta.decode_blocks, meta.decode_offsets].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        vd = v_cache[meta.decode_blocks, meta.decode_offsets].transpose(1, 2).to(q.dtype)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[meta.decode_rows] = od[:, :, 0, :]
    for seq in meta.prefills:
        qp = q[seq.start : seq.end].transpose(0, 1)[None]  # [1, Hq, n, D]
        kp = k_cache[seq.ctx_blocks, seq.ctx_offsets].transpose(0, 1)[None].to(q.dtype)
        vp = v_cache[seq.ctx_blocks, seq.ctx_offsets].transpose(0, 1)[None].to(q.dtype)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=seq.mask, scale=scale, enable_gqa=True)
        out[seq.start : seq.end] = op[0].transpose(0, 1)
    return out
