"""Paged attention over the engine's KV layout, and the metadata a step needs to run it.

KV layout (block-first): one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`. All
layers of a block are one contiguous run, so offloading or handing a block to another pod is one copy
(docs/architecture.md says why). A layer's K is the strided view `cache[:, layer, 0]`, indexed by
(block id, offset) pairs.

Two backends compute the same thing (docs/kernels.md):
- torch (CPU): new K/V are scattered into their slots, each sequence's context is gathered through its block
  table, and SDPA does the rest. Decoding sequences share one padded batched call; each prefilling sequence
  gets its own call with a causal mask shifted by its cached prefix.
- triton (CUDA; on a CPU only under TRITON_INTERPRET=1, for tests): engine/kernels/ reads the layout in place:
  one KV-write launch, one decode launch (split-K) and one extend launch per layer, no gathers.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvmesh.engine.config import ATTENTION_BACKENDS

if TYPE_CHECKING:
    from kvmesh.engine.kernels.decode import DecodeBatch
    from kvmesh.engine.kernels.extend import ExtendBatch


def resolve_backend(name: str, device: torch.device) -> str:
    """torch or triton for `name` on `device`: auto means triton on CUDA (when installed), torch elsewhere."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "triton":
        if not has_triton:
            raise ValueError("attention_backend triton needs the triton package")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend triton needs a CUDA device, or TRITON_INTERPRET=1 on a CPU "
                             "(Triton's interpreter: correct but very slow, for tests)")
    return name


@dataclass
class PrefillSeq:
    """One sequence computing several tokens: rows [start, end) of the flat batch over `context_len` tokens."""

    start: int
    end: int
    block_table: torch.Tensor  # [blocks covering the context]
    context_len: int
    mask: torch.Tensor  # [n, context_len] bool, True where attended (causal, shifted by the cached prefix)


@dataclass
class TorchMetadata:
    """Where a step's tokens write their K/V and what each sequence attends to (torch backend)."""

    slot_blocks: torch.Tensor  # [T] block of each new token
    slot_offsets: torch.Tensor  # [T] offset in that block
    decode_rows: torch.Tensor | None  # [B] flat-batch rows of single-token sequences
    decode_tables: torch.Tensor | None  # [B, max blocks] block tables, padded with block 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max blocks * block size] bool, True where attended
    prefills: list[PrefillSeq]


@dataclass(frozen=True)
class TritonMetadata:
    """The same step for the Triton kernels: slots and per-kind batches, built once, used by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset of each new token
    decode: DecodeBatch | None  # single-token sequences
    extend: ExtendBatch | None  # multi-token sequences (prefill, with or without a cached prefix)


AttentionMetadata = TorchMetadata | TritonMetadata


def build_metadata(
    seqs: list[tuple[list[int], int, int]], block_size: int, device: torch.device, backend: str = "torch"
) -> AttentionMetadata:
    """Metadata for a step. `seqs` holds (block table, tokens already computed, new tokens) per sequence, in
    flat-batch order. The torch path gathers contexts a whole block at a time: one copy of block_size tokens
    instead of one per token."""
    if backend == "triton":
        return _build_triton(seqs, block_size, device)
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
    meta = TorchMetadata(
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


def _build_triton(seqs: list[tuple[list[int], int, int]], block_size: int, device: torch.device) -> TritonMetadata:
    from kvmesh.engine.kernels.decode import DecodeBatch
    from kvmesh.engine.kernels.extend import ExtendBatch

    slots: list[int] = []
    dec_rows: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    ext_starts: list[int] = []
    ext_lens: list[int] = []
    ext_contexts: list[int] = []
    ext_tables: list[list[int]] = []
    row = 0
    for table, computed, n in seqs:
        context_len = computed + n
        slots += [table[pos // block_size] * block_size + pos % block_size for pos in range(computed, context_len)]
        used = table[: -(-context_len // block_size)]
        if n == 1:
            dec_rows.append(row)
            dec_tables.append(used)
            dec_lens.append(context_len)
        else:
            ext_starts.append(row)
            ext_lens.append(n)
            ext_contexts.append(context_len)
            ext_tables.append(used)
        row += n
    return TritonMetadata(
        torch.tensor(slots, dtype=torch.int64, device=device),
        DecodeBatch.build(dec_rows, dec_tables, dec_lens, device) if dec_rows else None,
        ExtendBatch.build(ext_starts, ext_lens, ext_contexts, ext_tables, device) if ext_starts else None,
    )


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
    if isinstance(meta, TritonMetadata):
        return _triton_attention(q, k, v, k_cache, v_cache, meta, scale)
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


def _triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TritonMetadata,
    scale: float,
) -> torch.Tensor:
    from kvmesh.engine.kernels.decode import decode_attention
    from kvmesh.engine.kernels.extend import extend_attention
    from kvmesh.engine.kernels.kv_write import write_kv

    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.decode is not None:
        decode_attention(q, k_cache, v_cache, meta.decode, scale, out=out)
    if meta.extend is not None:
        extend_attention(q, k_cache, v_cache, meta.extend, scale, out=out)
    return out
