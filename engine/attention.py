"""Paged attention over the engine's KV layout, and the metadata a step needs to run it.

KV layout (block-first): one tensor `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`. All
layers of a block are one contiguous run, so offloading or handing a block to another pod is one copy
(docs/architecture.md says why). A layer's K is the strided view `cache[:, layer, 0]`, indexed by
(block id, offset) pairs.

Two backends compute the same thing (docs/kernels.md):
- torch (CPU): new K/V are scattered into their slots, each sequence's context is gathered through its block
  table, and SDPA does the rest. Decoding sequences share one padded batched call; each prefilling sequence
  gets its own call with a causal mask shifted by its cached prefix. Decoding sequences whose block tables
  begin with the same blocks (the prefix cache hands them the very same blocks) attend "in cascade": the
  shared prefix once for the whole group (its K/V gathered once, their queries stacked into one matmul per KV
  head), each sequence's own suffix in a padded batch, and the two parts merged exactly by their log-sum-exp.
- triton (CUDA; on a CPU only under TRITON_INTERPRET=1, for tests): engine/kernels/ reads the layout in place:
  one KV-write launch, one decode launch (split-K) and one extend launch per layer, no gathers.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvmesh.engine.config import ATTENTION_BACKENDS
from kvmesh.engine.kvcache import LayerKV

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


@dataclass(frozen=True)
class PaddedDecode:
    """Single-token sequences as one padded batch: each attends over `tables` up to its own length."""

    rows: torch.Tensor  # [B] flat-batch rows
    tables: torch.Tensor  # [B, max blocks] block tables, padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max blocks * block size] bool, True where attended

    @staticmethod
    def build(rows: list[int], tables: list[list[int]], lens: list[int], block_size: int,
              device: torch.device) -> PaddedDecode:
        width = max(len(t) for t in tables)
        positions = torch.arange(width * block_size, device=device)
        mask = positions[None, :] < torch.tensor(lens, device=device)[:, None]
        padded = [t + [0] * (width - len(t)) for t in tables]
        return PaddedDecode(torch.tensor(rows, device=device), torch.tensor(padded, device=device),
                            mask[:, None, None, :])


@dataclass(frozen=True)
class CascadeGroup:
    """Decoding sequences whose block tables begin with the same full blocks: their queries attend over that
    prefix together; each one's own blocks after it are rows [suffix_start, suffix_start + n) of the
    metadata's `cascade_suffix` batch."""

    rows: torch.Tensor  # [n >= 2] flat-batch rows
    prefix_blocks: torch.Tensor  # [L] the shared leading blocks
    suffix_start: int


@dataclass
class TorchMetadata:
    """Where a step's tokens write their K/V and what each sequence attends to (torch backend)."""

    slot_blocks: torch.Tensor  # [T] block of each new token
    slot_offsets: torch.Tensor  # [T] offset in that block
    decode: PaddedDecode | None  # single-token sequences outside any cascade group: whole contexts
    cascade_groups: list[CascadeGroup]
    cascade_suffix: PaddedDecode | None  # the groups' members, over their blocks after the shared prefix
    prefills: list[PrefillSeq]


@dataclass(frozen=True)
class TritonMetadata:
    """The same step for the Triton kernels: slots and per-kind batches, built once, used by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset of each new token
    decode: DecodeBatch | None  # single-token sequences
    extend: ExtendBatch | None  # multi-token sequences (prefill, with or without a cached prefix)


AttentionMetadata = TorchMetadata | TritonMetadata

# A cascade group costs a fixed number of small calls per layer (the prefix matmuls, the merge, the suffix batch)
# whatever it saves, about as much as 50 to 100 block reads here; it is used when the block reads it saves,
# (members - 1) x shared blocks, reach this (docs/benchmarks.md, "Cascade attention": the break-even, measured).
CASCADE_MIN_SAVED_BLOCKS = 64


def shareable_blocks(context_len: int, block_size: int) -> int:
    """Leading blocks a decoding sequence may share: the full ones before the block its new token is written
    to, so every member keeps a non-empty suffix and no shared block is written this step."""
    return (context_len - 1) // block_size


def plan_cascade(tables: list[list[int]], shareable: list[int], min_saved: int) -> list[tuple[list[int], int]]:
    """Groups of decoding sequences (indices into `tables`) and how many leading blocks each group shares.

    Tables sorted lexicographically put those with long common prefixes next to each other, and the prefix a
    run of them shares is the least of its neighbours' common prefixes. A dynamic program then picks the
    runs that save the most block reads, (members - 1) x shared blocks, counting a run only when it saves at
    least `min_saved`: several distinct system prompts become several groups, and a few sequences sharing a
    longer prefix within a group split off when that saves more."""
    order = sorted(range(len(tables)), key=lambda i: tables[i])
    common: list[int] = []  # common[k]: blocks shared by order[k] and order[k + 1]
    for a, b in itertools.pairwise(order):
        limit = min(shareable[a], shareable[b])
        n = 0
        while n < limit and tables[a][n] == tables[b][n]:
            n += 1
        common.append(n)
    best = [0] * (len(order) + 1)  # best[j]: the most saved by groups among the first j sorted sequences
    start = [j - 1 for j in range(len(order) + 1)]  # start[j]: where the run ending at j - 1 begins
    prefix = [0] * (len(order) + 1)  # prefix[j]: the blocks that run shares (0: order[j - 1] alone)
    for j in range(2, len(order) + 1):
        best[j] = best[j - 1]
        shared = common[j - 2]
        for i in range(j - 2, -1, -1):  # the run order[i:j]: its shared prefix shrinks as it grows
            shared = min(shared, common[i])
            if shared == 0:
                break
            saved = (j - i - 1) * shared
            if saved >= min_saved and best[i] + saved > best[j]:
                best[j], start[j], prefix[j] = best[i] + saved, i, shared
    groups: list[tuple[list[int], int]] = []
    j = len(order)
    while j > 0:
        if prefix[j]:
            groups.append((order[start[j] : j], prefix[j]))
        j = start[j]
    return groups[::-1]


def build_metadata(
    seqs: list[tuple[list[int], int, int]],
    block_size: int,
    device: torch.device,
    backend: str = "torch",
    cascade: bool = True,
) -> AttentionMetadata:
    """Metadata for a step. `seqs` holds (block table, tokens already computed, new tokens) per sequence, in
    flat-batch order. The torch path gathers contexts a whole block at a time: one copy of block_size tokens
    instead of one per token; with `cascade`, decoding sequences that share leading blocks are grouped
    (plan_cascade) and attend over them once."""
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
    meta = TorchMetadata(torch.tensor(slot_blocks, device=device), torch.tensor(slot_offsets, device=device),
                         None, [], None, prefills)
    shareable = [shareable_blocks(n, block_size) for n in decode_lens]
    plan = plan_cascade(decode_tables, shareable, CASCADE_MIN_SAVED_BLOCKS) if cascade else []
    members: list[tuple[int, int]] = []  # (decoding sequence, the blocks it shares) in group order
    for group, shared in plan:
        meta.cascade_groups.append(CascadeGroup(torch.tensor([decode_rows[i] for i in group], device=device),
                                                torch.tensor(decode_tables[group[0]][:shared], device=device),
                                                len(members)))
        members += [(i, shared) for i in group]
    if members:
        meta.cascade_suffix = PaddedDecode.build([decode_rows[i] for i, _ in members],
                                                 [decode_tables[i][c:] for i, c in members],
                                                 [decode_lens[i] - c * block_size for i, c in members],
                                                 block_size, device)
    plain = sorted(set(range(len(decode_rows))) - {i for i, _ in members})
    if plain:
        meta.decode = PaddedDecode.build([decode_rows[i] for i in plain], [decode_tables[i] for i in plain],
                                         [decode_lens[i] for i in plain], block_size, device)
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
    layer_kv: tuple[LayerKV, LayerKV],
    meta: AttentionMetadata,
    scale: float,
    work_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Write this step's k, v ([T, Hkv, D]) into one layer's cache, then attend q ([T, Hq, D]) over each
    context. Returns [T, Hq, D]. `work_dtype`: the dtype the torch path reads the context and the queries in
    (None: fp32 on a CPU, q's dtype elsewhere; engine.pick_attention_dtype says when a CPU keeps bf16)."""
    k_cache, v_cache = layer_kv
    if isinstance(meta, TritonMetadata):
        return _triton_attention(q, k, v, k_cache, v_cache, meta, scale)
    k_cache.write(meta.slot_blocks, meta.slot_offsets, k)
    v_cache.write(meta.slot_blocks, meta.slot_offsets, v)
    out = torch.empty_like(q)
    _, _, heads, dim = k_cache.values.shape
    work = work_dtype or (torch.float32 if q.device.type == "cpu" else q.dtype)
    if meta.decode is not None:
        d = meta.decode
        kd, vd = _gather(k_cache, d.tables, work), _gather(v_cache, d.tables, work)
        b = d.rows.shape[0]
        # a KV head's queries (GQA: query head h reads KV head h // (Hq / Hkv)) as the rows of one problem
        qd = q[d.rows].to(work).view(b, heads, -1, dim)  # [B, Hkv, Hq / Hkv, D]
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scale)
        out[d.rows] = od.reshape(b, -1, dim).to(out.dtype)
    if meta.cascade_suffix is not None:
        _cascade_attention(q, k_cache, v_cache, meta.cascade_groups, meta.cascade_suffix, scale, out)
    for seq in meta.prefills:
        kp = k_cache.read(seq.block_table, work).view(-1, heads, dim)[: seq.context_len]
        vp = v_cache.read(seq.block_table, work).view(-1, heads, dim)[: seq.context_len]
        kp = kp.transpose(0, 1)[None]  # [1, Hkv, ctx, D]
        vp = vp.transpose(0, 1)[None]
        qp = q[seq.start : seq.end].transpose(0, 1)[None].to(work)  # [1, Hq, n, D]
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=seq.mask, scale=scale, enable_gqa=True)
        out[seq.start : seq.end] = op[0].transpose(0, 1).to(out.dtype)
    return out


def _gather(cache: LayerKV, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Hkv, blocks x block_size, D] for [B, blocks] block tables: one copy a block ([B, blocks, bs, Hkv, D]
    is contiguous, so merging blocks and offsets is free)."""
    b, width = tables.shape
    _, block_size, heads, dim = cache.values.shape
    return cache.read(tables.view(-1), dtype).view(b, width * block_size, heads, dim).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in fp32 that also returns the log-sum-exp of the scores, which SDPA does not, so two
    parts of one context can be merged. q [B, Hkv, M, D] (M: queries per KV head), k and v [B, Hkv, S, D],
    mask broadcastable to [B, Hkv, M, S] (True: attended; every row attends something). Returns the
    output [B, Hkv, M, D] and lse [B, Hkv, M]. Few, in-place ops: at a small group their count is the cost."""
    scores = torch.matmul(q.float() * scale, k.float().transpose(-1, -2))
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, v.float()).div_(total), total.log_().add_(top).squeeze(-1)


def _cascade_attention(
    q: torch.Tensor,
    k_cache: LayerKV,
    v_cache: LayerKV,
    groups: list[CascadeGroup],
    suffix: PaddedDecode,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Each group's queries over its shared prefix in one matmul per KV head (the prefix gathered once, not
    once per member), every member over its own suffix in one padded batch, merged by log-sum-exp: with
    weight sigmoid(lse_prefix - lse_suffix) on the prefix part, the softmax over the whole context."""
    _, _, heads, dim = k_cache.values.shape
    per_kv = q.shape[1] // heads  # query heads per KV head (GQA): query head h reads KV head h // per_kv
    b = suffix.rows.shape[0]
    qs = q[suffix.rows].view(b, heads, per_kv, dim)
    merged, lse_s = _attend(qs, _gather(k_cache, suffix.tables, q.dtype), _gather(v_cache, suffix.tables, q.dtype),
                            suffix.mask, scale)  # the suffix parts; each group's prefix part is merged into its rows
    for g in groups:
        n = g.rows.shape[0]
        part = slice(g.suffix_start, g.suffix_start + n)
        kp = k_cache.read(g.prefix_blocks, q.dtype).view(-1, heads, dim).transpose(0, 1)  # [Hkv, P, D]
        vp = v_cache.read(g.prefix_blocks, q.dtype).view(-1, heads, dim).transpose(0, 1)
        qg = qs[part].transpose(0, 1).reshape(heads, n * per_kv, dim)
        op, lse_p = _attend(qg, kp, vp, None, scale)  # [Hkv, n x per_kv, D], [Hkv, n x per_kv]
        prefix_weight = torch.sigmoid(lse_p.view(heads, n, per_kv).transpose(0, 1) - lse_s[part])
        merged[part].lerp_(op.view(heads, n, per_kv, dim).transpose(0, 1), prefix_weight[..., None])
    out[suffix.rows] = merged.view(b, heads * per_kv, dim).to(out.dtype)


def _triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: LayerKV,
    v_cache: LayerKV,
    meta: TritonMetadata,
    scale: float,
) -> torch.Tensor:
    from kvmesh.engine.kernels.common import Scales
    from kvmesh.engine.kernels.decode import decode_attention
    from kvmesh.engine.kernels.extend import extend_attention
    from kvmesh.engine.kernels.kv_write import write_kv

    scales = None if k_cache.scales is None or v_cache.scales is None else Scales(k_cache.scales, v_cache.scales)
    kc, vc = k_cache.values, v_cache.values
    write_kv(k, v, kc, vc, meta.slot_mapping, scales)
    out = torch.empty_like(q)
    if meta.decode is not None:
        decode_attention(q, kc, vc, meta.decode, scale, out=out, scales=scales)
    if meta.extend is not None:
        extend_attention(q, kc, vc, meta.extend, scale, out=out, scales=scales)
    return out
