"""Plain torch references for every kernel: gather the blocks, then compute in fp32. Slow and obvious on
purpose; the tests and the benchmark's correctness pass compare the kernels against these."""

from __future__ import annotations

import torch

# |kernel - reference| <= TOLERANCE * (1 + |reference|) per input dtype: fp32 differs by summation order only;
# fp16 probabilities enter the P.V product in fp16 (and outputs round at 2^-11); bf16 outputs round at 2^-8
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def gather_context(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """One layer's K or V of a sequence as [length, Hkv, D] fp32, read through its block table."""
    ids = torch.tensor(table, dtype=torch.long, device=cache.device)
    return cache.index_select(0, ids).flatten(0, 1)[:length].float()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at absolute positions q_pos attends causally over k, v [ctx, Hkv, D]; fp32 [n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q.float(), k) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(dim=-1), v)


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: list[int],
    tables: list[list[int]],
    context_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """fp32 [len(rows), Hq, D]: q[rows[i]] over sequence i's whole context."""
    outs = []
    for row, table, length in zip(rows, tables, context_lens, strict=True):
        k = gather_context(k_cache, table, length)
        v = gather_context(v_cache, table, length)
        outs.append(attend(q[row : row + 1], k, v, torch.tensor([length - 1], device=q.device), scale))
    return torch.cat(outs)


def extend_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_starts: list[int],
    q_lens: list[int],
    context_lens: list[int],
    tables: list[list[int]],
    scale: float,
) -> list[torch.Tensor]:
    """fp32 [q_len, Hq, D] per sequence: its new rows over the cached prefix and, causally, each other."""
    outs = []
    for start, n, length, table in zip(q_starts, q_lens, context_lens, tables, strict=True):
        k = gather_context(k_cache, table, length)
        v = gather_context(v_cache, table, length)
        q_pos = torch.arange(length - n, length, device=q.device)
        outs.append(attend(q[start : start + n], k, v, q_pos, scale))
    return outs


def write_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    keep = slots >= 0
    page = k_cache.shape[1]
    blocks, offsets = slots[keep] // page, slots[keep] % page
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def gather_blocks_reference(kv: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return kv.index_select(0, ids.long())


def scatter_blocks_reference(kv: torch.Tensor, ids: torch.Tensor, data: torch.Tensor) -> None:
    kv.index_copy_(0, ids.long(), data)
